"""Which tokenizer encodes a worker's prompts: chosen per model, loaded once, or why none.

Exact mode needs the token ids the worker itself computes, so the tokenizer follows the
worker's model: ``kv_events.tokenizers`` maps a model name (any name the worker serves
under: ``served_model_name``, its model path) to a spec (with its chat template in
``kv_events.chat_templates``; ``models.<name>.tokenizer`` and ``.chat_template`` are folded
into these two by the config), ``kv_events.tokenizer`` (with ``kv_events.chat_template``)
is the default for every other model. A worker whose model has no tokenizer, or whose
tokenizer could not be loaded (a missing optional package, a bad directory), stays in
approximate mode, and :meth:`TokenizerChoice.for_models` says why (shown per worker in
``/workers`` and on the dashboard).

Loading is strict (``kv_events.enabled: true``: any failure refuses the configuration)
or lenient (``auto``: a failure is one warning and a reason). Each spec is loaded once
per process (``load_cached``): the configuration check at start and the runtime share it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.config import ConfigError, KVEventsConfig
from gateway.exact.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

NO_TOKENIZER = "no tokenizer configured for its model (--tokenizer-path, kv_events.tokenizer)"


@dataclass(frozen=True, slots=True)
class TokenizerChoice:
    """The default tokenizer, the per-model ones, and why any configured one is missing."""

    default: Tokenizer | None = None
    per_model: Mapping[str, Tokenizer] = field(default_factory=dict)
    # model name ("" for the default) -> why its configured tokenizer could not be loaded
    problems: Mapping[str, str] = field(default_factory=dict)

    def for_models(self, names: Iterable[str]) -> tuple[Tokenizer | None, str | None]:
        """The tokenizer for a worker serving under ``names``, or None and the reason."""
        for name in sorted(names):  # sorted: one answer whatever the set's order
            if name in self.per_model:
                return self.per_model[name], None
            if name in self.problems:
                return None, self.problems[name]
        if self.default is not None:
            return self.default, None
        return None, self.problems.get("", NO_TOKENIZER)


@functools.lru_cache(maxsize=64)
def load_cached(
    spec: str, chat_template: str = "", render_budget_s: float | None = None
) -> Tokenizer:
    """:func:`gateway.exact.tokenizer.load_tokenizer`, once per (spec, template, budget)."""
    return load_tokenizer(spec, chat_template or None, render_budget_s)


@functools.lru_cache(maxsize=8)
def load_worker_cached(directory: str, chat_template: str, render_budget_s: float) -> Tokenizer:
    """A tokenizer a worker's ``/server_info`` names (resolved paths): a cache of its own,
    small, so workers naming many directories cannot pin many tokenizers in memory."""
    return load_tokenizer(f"hf:{directory}", chat_template or None, render_budget_s)


def load_choice(k: KVEventsConfig) -> TokenizerChoice:
    """Load what ``k`` configures; strict when ``k.enabled == "true"`` (ConfigError naming
    the key), else each failure becomes a logged reason."""
    strict = k.enabled == "true"
    specs = [("", "kv_events.tokenizer", k.tokenizer, k.chat_template)]
    specs += [
        (m, f"kv_events.tokenizers.{m}", s, k.chat_templates.get(m, ""))
        for m, s in sorted(k.tokenizers.items())
    ]
    default: Tokenizer | None = None
    per_model: dict[str, Tokenizer] = {}
    problems: dict[str, str] = {}
    for model, key, spec, template in specs:
        if not spec:
            continue
        try:
            tok = load_cached(spec, template, k.max_render_s)
        except Exception as exc:  # ImportError, OSError, ValueError, a tokenizer's own
            reason = f"tokenizer {spec!r} could not be loaded: {type(exc).__name__}: {exc}"
            if strict:
                raise ConfigError(f"{key}: {reason}") from None
            log.warning("kv events: %s (%s); its workers stay approximate", reason, key)
            problems[model] = reason
            continue
        if model:
            per_model[model] = tok
        else:
            default = tok
    return TokenizerChoice(default, per_model, problems)
