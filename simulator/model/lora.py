"""LoRA adapters of one simulated SGLang worker: which are loaded, which were ever loaded,
and SGLang 0.5.23's rules and messages for loading, unloading and naming them in requests.

What SGLang does (``python/sglang/srt/managers/tokenizer_control_mixin.py``
``load_lora_adapter`` / ``unload_lora_adapter``, ``tokenizer_manager.py``
``_validate_and_resolve_lora``, ``lora/lora_manager.py`` ``validate_new_adapter``,
``lora/lora_registry.py``), and so what this class does:

- Adapters are known by *name*; a request's ``lora_path`` is a name, not a path.
- ``load`` fails (``success: false``, HTTP 400) when LoRA is off, when the name is already
  loaded, or when pinning it would pin ``max_loras_per_batch - 1`` adapters; on success the
  adapter is registered and remembered for good (``lora_ref_cache``), and while more than
  ``max_loaded_loras`` are loaded the least recently used unpinned one is unloaded.
- ``unload`` of a name not loaded fails with the registry's message.
- A request naming an adapter that is not loaded but was loaded once (then unloaded or
  evicted) gets it *reloaded implicitly*; one never loaded is a ``ValueError`` ("Got LoRA
  adapter that has never been loaded"), as is any adapter with LoRA off, or more distinct
  adapters in one request than ``max_loaded_loras``.

Not modelled: weights (any path loads), adapter ranks and target modules, an unload
waiting for the requests still using the adapter (here it is immediate), DP attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass(frozen=True, slots=True)
class LoraRef:
    name: str
    path: str
    pinned: bool = False


@dataclass(slots=True)
class LoraUpdate:
    """SGLang's ``LoRAUpdateOutput``: the body of a load or unload answer."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
    evicted: list[str] = field(default_factory=list)  # unloaded to respect max_loaded_loras

    def body(self) -> dict[str, object]:
        return {
            "success": self.success,
            "error_message": self.error_message,
            "loaded_adapters": self.loaded_adapters,
        }


def parse_lora_spec(spec: str) -> LoraRef:
    """One ``--lora-paths`` item: ``NAME=PATH``, ``PATH`` (named by itself) or JSON
    ``{"lora_name", "lora_path", "pinned"}`` (SGLang's ``LoRAPathAction``)."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"invalid LoRA JSON spec {spec!r}: {exc}") from None
        name, path, pinned = obj.get("lora_name"), obj.get("lora_path"), obj.get("pinned", False)
        if not isinstance(name, str) or not isinstance(path, str) or not isinstance(pinned, bool):
            raise ValueError(f"LoRA JSON spec needs lora_name and lora_path strings: {spec!r}")
        return LoraRef(name, path, pinned)
    name, sep, path = text.partition("=")
    if not name or (sep and not path):
        raise ValueError(f"invalid LoRA spec {spec!r}: expected NAME=PATH or PATH")
    return LoraRef(name, path if sep else name, False)


def _keys(names: Iterable[str]) -> str:
    """How SGLang's messages print a dict's keys."""
    return f"dict_keys({list(names)!r})"


class LoraAdapters:
    """The adapters of one worker (see module docstring)."""

    def __init__(
        self,
        enabled: bool,
        initial: Iterable[LoraRef] = (),
        max_loras_per_batch: int = 8,
        max_loaded_loras: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        self._loaded: dict[str, LoraRef] = {}  # in load order, as /v1/models lists them
        self._used: dict[str, int] = {}  # name → tick of its last use (LRU)
        self._known: dict[str, LoraRef] = {}  # ever loaded (SGLang's lora_ref_cache)
        self._tick = 0
        # the simulator's own counters (no SGLang equivalent), in /server_info: adapters
        # loaded (explicitly or by an implicit reload), of those implicit reloads, and
        # adapters unloaded to respect max_loaded_loras
        self.loads = 0
        self.reloads = 0
        self.evictions = 0
        if enabled:
            for ref in initial:
                self._register(ref)

    def loaded(self) -> list[LoraRef]:
        return list(self._loaded.values())

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def _register(self, ref: LoraRef) -> None:
        self._loaded[ref.name] = ref
        self._known[ref.name] = ref
        self._touch(ref.name)

    def _touch(self, name: str) -> None:
        self._tick += 1
        self._used[name] = self._tick

    def _result(self, success: bool, message: str | None = None) -> LoraUpdate:
        return LoraUpdate(success, message, {r.name: r.path for r in self._loaded.values()})

    def load(self, ref: LoraRef) -> LoraUpdate:
        if not self.enabled:
            return LoraUpdate(False, NOT_ENABLED)
        if ref.name in self._loaded:
            return self._result(
                False, f"Failed to load LoRA adapter {ref.name} because it is already loaded"
            )
        pinned = sum(1 for r in self._loaded.values() if r.pinned)
        if ref.pinned and pinned >= self.max_loras_per_batch - 1:
            return self._result(
                False,
                f"Failed to load LoRA adapter {ref.name} as a pinned adapter. It is not "
                "allowed to pin all slots in the LoRA memory pool to avoid starvation for "
                "unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters.",
            )
        self._register(ref)
        evicted: list[str] = []
        limit = self.max_loaded_loras
        while limit is not None and len(self._loaded) > limit:
            victims = [n for n, r in self._loaded.items() if not r.pinned and n != ref.name]
            if not victims:
                break
            lru = min(victims, key=lambda n: self._used.get(n, 0))
            del self._loaded[lru]
            evicted.append(lru)
        self.loads += 1
        self.evictions += len(evicted)
        result = self._result(True)
        result.evicted = evicted
        return result

    def unload(self, name: str) -> LoraUpdate:
        if not self.enabled:
            return LoraUpdate(False, NOT_ENABLED)
        if name not in self._loaded:
            return LoraUpdate(
                False,
                f"LoRA with name {name} does not exist. Loaded LoRAs: {_keys(self._loaded)}",
            )
        del self._loaded[name]
        return self._result(True)

    def resolve(self, names: list[str]) -> list[LoraRef]:
        """Check a request's adapters (ValueError with SGLang's text); returns those to
        reload implicitly (loaded once, not now). Each named adapter counts as used."""
        if not names:
            return []
        if not self.enabled:
            raise ValueError(
                f"LoRA adapter '{names[0]}' was requested, but LoRA is not enabled. Please "
                "launch the server with --enable-lora flag and preload adapters using "
                "--lora-paths or /load_lora_adapter endpoint."
            )
        unique = list(dict.fromkeys(names))
        if self.max_loaded_loras is not None and len(unique) > self.max_loaded_loras:
            raise ValueError(
                f"Received request with {len(unique)} unique loras requested but max loaded "
                f"loras is {self.max_loaded_loras}"
            )
        reload: list[LoraRef] = []
        for name in unique:
            if name in self._loaded:
                self._touch(name)
                continue
            known = self._known.get(name)
            if known is None:
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {_keys(self._known)}."
                )
            reload.append(known)
        self.reloads += len(reload)
        return reload
