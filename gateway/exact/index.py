"""Exact mode's index: the blocks each worker reported, and the blocks predicted to follow.

* :class:`ExactIndex` holds, per worker and DP rank, the blocks the worker reported.
  Blocks are keyed by the **gateway's own** chained hash of their token ids
  (:func:`chain_hashes`, XXH3-64 seeded by the previous block, the root seeded by the
  namespace: LoRA, ``cache_salt``, ``extra_key``; :func:`namespace_seed`); the engine's
  hashes serve only as ids, to link a ``BlockStored`` to its parent and to apply
  ``BlockRemoved``. A store whose parent is unknown (events lost before we subscribed) is
  dropped: the index may then under-predict, never over-predict. Blocks whose
  ``block_size`` differs from the worker's advertised one are dropped too (as Dynamo
  does). The key is the routing target: a worker with DP ranks routed to separately is
  keyed per rank (``<worker>@dp<rank>``), so a match asks what *that rank* holds; under
  the worker's own id, ranks are unioned.
* **Tiers** (HiCache, docs/KV_EVENTS.md "With HiCache"): one set per (worker, rank,
  medium). Events of medium ``GPU`` (or none) keep the device set, ``CPU_PINNED`` the
  host set (a host copy's store links to its parent in either set); a block may be in
  both (a GPU block backed up to the host). A request's match is its GPU part, then the
  host part that continues it (:meth:`ExactIndex.holds_host`): the engine loads that back
  rather than recompute it. Storage media (``DISK``, ``EXTERNAL``) are ignored, and so is
  every non-GPU event with ``host_tier=False`` (the device-only index of before, which
  under write-through is exactly what reading every event as GPU gave).
* :class:`PredictedBlocks` (the hybrid): blocks of a request dispatched to an exact-mode
  worker are kept as *predicted* entries for a TTL, so siblings of a prompt still in
  prefill co-locate. The TTL is ``ttl_factor`` times the running mean of the observed
  delay between dispatch and the ``BlockStored`` that confirms the prediction, clamped to
  ``[ttl_min_s, ttl_max_s]``.

Cost: a store hashes its blocks once (one XXH3 per block); a match is one set lookup per
leading block per worker. No I/O; time is passed in. Not thread-safe: one event loop.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

from gateway.config.workerspec import split_target_id
from gateway.exact.wire import GPU, HOST, Cleared, Event, Removed, Stored

Namespace = tuple[str | None, str | None, str | None]  # (LoRA, cache_salt, extra_key)


def namespace_seed(lora: str | None, cache_salt: str | None, extra_key: str | None) -> int:
    """The chain seed of a cache namespace (the empty namespace included)."""
    key = f"{lora or ''}\x00{cache_salt or ''}\x00{extra_key or ''}".encode()
    return xxh3_64_intdigest(key)


def chain_hashes(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The gateway's hash of each full block, chained: block i's hash seeds block i+1's."""
    out: list[int] = []
    h = seed
    n = len(token_ids) - len(token_ids) % block_size
    pack = struct.Struct(f"<{block_size}I").pack
    for start in range(0, n, block_size):
        h = xxh3_64_intdigest(pack(*token_ids[start : start + block_size]), seed=h)
        out.append(h)
    return out


@dataclass(slots=True)
class _RankBlocks:
    by_engine: dict[int, int] = field(default_factory=dict)  # engine hash → our hash (GPU)
    host_by_engine: dict[int, int] = field(default_factory=dict)  # the host tier's (HiCache)


class ExactIndex:
    """Blocks each worker reported, keyed by our own chained hashes (module docstring);
    ``host_tier``: keep HiCache's host copies (``CPU_PINNED`` events) as a tier."""

    def __init__(self, host_tier: bool = True) -> None:
        self._ranks: dict[tuple[str, int], _RankBlocks] = {}
        self._held: dict[str, dict[int, int]] = {}  # worker → our hash → ranks holding it
        self._host_held: dict[str, dict[int, int]] = {}  # the same, on the host tier
        self.host_tier = host_tier
        self.dropped_orphans = 0
        self.dropped_block_size = 0

    def apply(self, worker_id: str, rank: int, event: Event, block_size: int) -> list[int]:
        """Apply one event; return our hashes of the GPU blocks it stored (the hybrid's)."""
        if isinstance(event, Cleared):
            self.clear(worker_id, rank)
            return []
        medium = event.medium
        if medium != GPU and (medium != HOST or not self.host_tier):
            return []  # a tier not followed (storage, or the host with host_tier off)
        state = self._ranks.setdefault((worker_id, rank), _RankBlocks())
        host = medium == HOST
        held = (self._host_held if host else self._held).setdefault(worker_id, {})
        blocks = state.host_by_engine if host else state.by_engine
        if isinstance(event, Removed):
            for eh in event.block_hashes:
                ours = blocks.pop(eh, None)
                if ours is not None:
                    self._release(held, ours)
            return []
        stored = self._store(state, blocks, held, event, block_size)
        return [] if host else stored

    def _store(
        self,
        state: _RankBlocks,
        blocks: dict[int, int],
        held: dict[int, int],
        event: Stored,
        block_size: int,
    ) -> list[int]:
        if event.block_size != block_size or block_size <= 0:
            self.dropped_block_size += 1
            return []
        if event.parent is None:
            seed = namespace_seed(event.lora_name, event.cache_salt, None)
        else:
            # a parent on either tier: a host copy's parent may still be on the GPU, a
            # block loaded back may hang off one that is host-only
            parent = state.by_engine.get(event.parent)
            if parent is None:
                parent = state.host_by_engine.get(event.parent)
            if parent is None:
                self.dropped_orphans += 1
                return []
            seed = parent
        ours = chain_hashes(event.token_ids, block_size, seed)
        for eh, h in zip(event.block_hashes, ours, strict=False):
            if eh not in blocks:
                blocks[eh] = h
                held[h] = held.get(h, 0) + 1
        return ours

    @staticmethod
    def _release(held: dict[int, int], h: int) -> None:
        count = held.get(h, 0) - 1
        if count > 0:
            held[h] = count
        else:
            held.pop(h, None)

    def clear(self, worker_id: str, rank: int | None = None) -> None:
        """Drop a rank's blocks, or all of a worker's (``rank=None``; with those kept
        under its DP ranks' target ids, ``gateway.config.workerspec.rank_target_id``)."""
        for key in [k for k in self._ranks if _of(k[0], worker_id) and rank in (None, k[1])]:
            held = self._held.get(key[0], {})
            host_held = self._host_held.get(key[0], {})
            state = self._ranks.pop(key)
            for h in state.by_engine.values():
                self._release(held, h)
            for h in state.host_by_engine.values():
                self._release(host_held, h)

    def holds(self, worker_id: str, h: int) -> bool:
        """Whether the worker (any rank) holds block ``h`` on its GPU."""
        return h in self._held.get(worker_id, ())

    def holds_host(self, worker_id: str, h: int) -> bool:
        """Whether the worker (any rank) holds block ``h`` on its host tier (HiCache)."""
        return h in self._host_held.get(worker_id, ())

    def blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def host_blocks(self, worker_id: str) -> int:
        return len(self._host_held.get(worker_id, ()))

    def match(self, hashes: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds (0 omitted)."""
        out: dict[str, int] = {}
        for wid in worker_ids:
            held = self._held.get(wid)
            if not held:
                continue
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[wid] = n
        return out


class PredictedBlocks:
    """Blocks dispatched but not yet confirmed by an event, with a TTL per recording.

    The TTL follows the observed dispatch → ``BlockStored`` delay (module docstring).
    """

    def __init__(self, ttl_factor: float, ttl_min_s: float, ttl_max_s: float) -> None:
        self._by_worker: dict[str, dict[int, tuple[float, float]]] = {}  # h → (sent, expiry)
        self._factor, self._min, self._max = ttl_factor, ttl_min_s, ttl_max_s
        self.mean_delay_s: float | None = None

    @property
    def ttl_s(self) -> float:
        delay = self.mean_delay_s if self.mean_delay_s is not None else self._max / self._factor
        return min(self._max, max(self._min, self._factor * delay))

    def record(self, worker_id: str, hashes: Sequence[int], now: float) -> None:
        blocks = self._by_worker.setdefault(worker_id, {})
        expiry = now + self.ttl_s
        for h in hashes:
            blocks[h] = (now, expiry)
        if len(blocks) > 4 * len(hashes) + 1024:
            self.expire(worker_id, now)

    def confirm(self, worker_id: str, hashes: Iterable[int], now: float) -> None:
        blocks = self._by_worker.get(worker_id)
        if not blocks:
            return
        for h in hashes:
            entry = blocks.pop(h, None)
            if entry is not None:
                delay = now - entry[0]
                mean = self.mean_delay_s
                self.mean_delay_s = delay if mean is None else 0.9 * mean + 0.1 * delay

    def expire(self, worker_id: str, now: float) -> None:
        blocks = self._by_worker.get(worker_id, {})
        for h in [h for h, (_, exp) in blocks.items() if exp <= now]:
            del blocks[h]

    def holds(self, worker_id: str, h: int, now: float) -> bool:
        entry = self._by_worker.get(worker_id, {}).get(h)
        return entry is not None and entry[1] > now

    def forget(self, worker_id: str) -> None:
        """Drop a worker's predictions (its DP ranks' too)."""
        for key in [k for k in self._by_worker if _of(k, worker_id)]:
            del self._by_worker[key]


def _of(key: str, worker_id: str) -> bool:
    """``key`` is ``worker_id`` or the target id of one of its DP ranks."""
    return key == worker_id or split_target_id(key)[0] == worker_id
