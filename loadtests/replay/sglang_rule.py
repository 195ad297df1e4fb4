"""Reference policy for the replay: sglang-router 0.3.2's ``cache_aware`` rule.

Not a product policy (it lives here, not in ``policies/``): it is the peer the replay
compares against, re-implemented from its documented behaviour
(``../shared/docs/PEERS.md`` §1):

1. *imbalanced* iff ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > min_load * balance_rel_threshold`` (load = the router's own in-flight
   count per worker) → the least-loaded worker, cache ignored;
2. else ``match_rate = matched_chars / input_chars``; if ``match_rate > cache_threshold``
   → the worker that first inserted the deepest matched node;
3. else the least-loaded worker, **ties to the first worker in the list**.
The prompt is then inserted into the router's tree under the chosen worker, whatever the
branch. The tree is built only from the router's own decisions: no engine feedback.

Deviations, on purpose: the tree is kept at the gateway's 64-character block granularity
(chained block hashes) instead of single characters — matches differ by under one block
on prompts of thousands of characters; the per-worker size bound
(``max_tree_size`` characters, default 67,108,864) is enforced on insert (LRU of blocks)
instead of by a job every 60 s. With the default bound nothing is evicted on the bundled
traces in either case.

It reads the request's block hashes and block size from the
:class:`~policies.base.RouteContext` (``block_hashes``, ``block_chars``), which the
routing core fills for every policy; it does not use the gateway's prefix index
(``uses_prefix_match`` is False), so the core neither matches nor records for it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

from policies.base import Decision, Policy, RouteContext, WorkerView

REFERENCE_NAME = "sglang_cache_aware"
_BLOCK_CHARS = 64  # the gateway's default block size, when a context names none


class SglangCacheAware(Policy):
    """sglang-router's ``cache_aware`` (CLI defaults 0.3 / 64 / 1.5)."""

    name: ClassVar[str] = REFERENCE_NAME

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 67_108_864,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._holders: dict[int, list[str]] = {}  # block -> workers, first inserter first
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def select(self, ctx: RouteContext) -> Decision:
        """Without block hashes in ``ctx``, only the load rule applies."""
        block_hashes, block_chars = ctx.block_hashes, ctx.block_chars or _BLOCK_CHARS
        views = ctx.candidates
        loads = [w.in_flight for w in views]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen, reason = _first_least_loaded(views), "imbalance"
        else:
            matched, owner = self._match(block_hashes, {w.id for w in views})
            chars = max(1, ctx.prompt_chars)
            if owner is not None and matched * block_chars / chars > self.cache_threshold:
                chosen, reason = owner, "prefix_hit"
            else:
                chosen, reason = _first_least_loaded(views), "miss"
        self._insert(block_hashes, chosen, block_chars)
        return Decision(chosen, reason)

    def _match(self, block_hashes: Sequence[int], live: set[str]) -> tuple[int, str | None]:
        depth, owner = 0, None
        for h in block_hashes:
            holders = [w for w in self._holders.get(h, ()) if w in live]
            if not holders:
                break
            depth, owner = depth + 1, holders[0]
        return depth, owner

    def _insert(self, block_hashes: Sequence[int], worker: str, block_chars: int) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in reversed(block_hashes):  # deepest first: the root stays most recent
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, []).append(worker)
        limit = max(1, self.max_tree_size // block_chars)
        while len(lru) > limit:
            h, _ = lru.popitem(last=False)
            holders = self._holders[h]
            holders.remove(worker)
            if not holders:
                del self._holders[h]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "max_tree_size": self.max_tree_size,
        }


def _first_least_loaded(views: Sequence[WorkerView]) -> str:
    best = min(w.in_flight for w in views)
    return next(w.id for w in views if w.in_flight == best)
