"""The radix cache with HiCache's host tier under it, as SGLang 0.5.23's ``UnifiedRadixCache``
with ``--enable-hierarchical-cache`` keeps it (``unified_cache/unified_tree_core.py``).

One tree, two places a node's KV can be (settings and sources: :mod:`simulator.model.hicache`):

* **on the device** (the GPU pool :class:`~simulator.model.radix_cache.RadixCache` accounts
  for) and possibly **backed up** to the host too (``backuped``);
* **host-only**: evicted from the device but kept in the tree with its host copy.

Device nodes are prefix-closed (a device node's parent is on the device), so a request's
match is a device part followed by a host part, as SGLang's ``match_prefix`` returns it. A
node lives in its parent's ``children`` while on the device and in its parent's
``host_children`` while host-only, so everything :class:`RadixCache` does with
``children`` (leaves, LRU, locks, counters) keeps meaning the device tree.

What moves a node, with the KV events SGLang records (``medium`` ``GPU`` or
``CPU_PINNED``):

* **insert** (``write_through``: hit count 1; ``write_through_selective``: 2, counting one
  hit per inserting request, past what that request inserted before): the node and its
  not-yet-copied ancestors are copied to the host, top down, making host room by evicting
  host-only LRU leaves, stopping at the first that finds none. ``BlockStored`` GPU, then
  ``BlockStored`` CPU_PINNED per copy (SGLang records the latter when the asynchronous
  copy is acknowledged, a scheduler iteration or so later; here at once).
* **device eviction** of a backed-up leaf: demoted to host-only, ``BlockRemoved`` GPU.
  Under ``write_back`` an un-copied leaf is first copied synchronously (the copy's time
  stalls the step: :meth:`take_stall_s`), making host room by releasing host copies of
  nodes still on the device (two passes, sparing then taking device leaves), then host-only
  LRU leaves: ``BlockStored`` CPU_PINNED, ``BlockRemoved`` GPU. A leaf that cannot be
  copied (write-through: never was; write-back: no host room) is dropped with its host-only
  subtree (``BlockRemoved`` CPU_PINNED per descendant, then GPU), counted in
  ``dropped_tokens`` (reason ``write_through_unbacked_eviction`` under ``write_through``,
  ``host_pressure`` under ``write_back``; SGLang counts none for the selective policy).
* **host eviction** of a host-only leaf (no host-only children): ``BlockRemoved``
  CPU_PINNED; the node leaves the tree.
* **load back** (:meth:`load_back`, at admission): the host part of a match (at least
  ``load_back_threshold`` tokens, else it is recomputed) gets device slots (evicting device
  LRU leaves; the host nodes are pinned meanwhile) and returns to the device, keeping its
  host copy: ``BlockStored`` GPU per node. An insert through host-only nodes (a request
  that computed their tokens again) revives them the same way with its own KV.
* **reset**: everything, both tiers; one ``AllBlocksCleared``.

The listener's host hooks are optional (``on_host_stored(node)``, ``on_host_removed(node)``),
like ``on_split``. Transfer times are modelled, not slept: a load's seconds are the
worker's to charge (:meth:`record_load`), a write-back stall accumulates in
:meth:`take_stall_s`; ``on_transfer`` (when set) is told of each copy for histograms.

:class:`HiRadixCache` is over 400 lines: every move between the tiers changes the same
counters, heaps and events, so they stay in one class; the settings and the link are in
:mod:`simulator.model.hicache`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

from simulator.model.hicache import HiCacheSettings
from simulator.model.radix_cache import (
    TOKEN_BYTES,
    CacheListener,
    RadixCache,
    TreeNode,
    common_prefix_bytes,
)

TransferObserver = Callable[[str, int, float], None]  # ("load" | "backup", tokens, seconds)


class HostNode(TreeNode):
    """A node of the tiered tree: on the device (in ``parent.children``) or host-only (in
    ``parent.host_children``, ``evicted`` true), ``backuped`` when it has a host copy."""

    __slots__ = ("backuped", "hit_count", "host_children")

    def __init__(self, key: bytes, parent: TreeNode | None, namespace: str) -> None:
        super().__init__(key, parent, namespace)
        self.host_children: dict[bytes, HostNode] = {}
        self.backuped = False
        self.hit_count = 0


def _h(node: TreeNode) -> HostNode:
    return cast(HostNode, node)


@dataclass
class HiCacheCounters:
    """Running totals since start (``/metrics``' HiCache families, ``/_sim/stats``)."""

    backup_tokens: int = 0  # device -> host copies
    backup_bytes: int = 0
    load_tokens: int = 0  # host -> device loads
    load_bytes: int = 0
    host_evicted_tokens: int = 0
    dropped_tokens: dict[str, int] = field(default_factory=dict)  # by reason


class HiRadixCache(RadixCache):
    """The device radix cache plus the host tier (see module docstring)."""

    node_class = HostNode

    def __init__(
        self,
        capacity: int,
        page_size: int,
        listener: CacheListener | None,
        settings: HiCacheSettings,
    ) -> None:
        super().__init__(capacity, page_size, listener)
        self.settings = settings
        self.host_capacity = settings.host_tokens
        self.host_used = 0
        self.counters = HiCacheCounters()
        if settings.write_policy == "write_through":
            self.counters.dropped_tokens["write_through_unbacked_eviction"] = 0
        if settings.write_back:
            self.counters.dropped_tokens["host_pressure"] = 0
        self.on_transfer: TransferObserver | None = None
        self._host_stored = getattr(listener, "on_host_stored", None)
        self._host_removed = getattr(listener, "on_host_removed", None)
        self._host_heap: list[tuple[int, int, HostNode]] = []
        self._host_nodes = 0  # host-only nodes
        self._duplicates: dict[int, HostNode] = {}  # write_back: on the device and the host
        self._pinned: set[int] = set()  # host-only nodes a load is about to take
        self._stall_s = 0.0

    # ------------------------------------------------------------------ figures
    @property
    def host_available(self) -> int:
        return self.host_capacity - self.host_used

    def take_stall_s(self) -> float:
        """Modelled seconds the scheduler waited for write-back copies since the last call."""
        stall, self._stall_s = self._stall_s, 0.0
        return stall

    def record_load(self, tokens: int) -> float:
        """Count one step's merged host -> device load of ``tokens``; its modelled seconds."""
        if tokens <= 0:
            return 0.0
        seconds = self.settings.copy_s(tokens)
        self.counters.load_tokens += tokens
        self.counters.load_bytes += tokens * self.settings.kv_bytes_per_token
        if self.on_transfer is not None:
            self.on_transfer("load", tokens, seconds)
        return seconds

    # ------------------------------------------------------------------ matching
    def host_hit(self, node: TreeNode, key: bytes, device_tokens: int) -> int:
        """Tokens of ``key`` past the device match (``device_tokens``, ending at ``node``)
        that host-only nodes hold, page-aligned; 0 below ``load_back_threshold``. Refreshes
        the host nodes' access time (the tick of the device match just made)."""
        key = self._aligned(key)
        tick = self._clock
        pos, n, pb = device_tokens * TOKEN_BYTES, len(key), self._page_bytes
        cur = _h(node)
        while pos < n:
            child = cur.host_children.get(key[pos : pos + pb])
            if child is None:
                break
            child.last_access = tick
            if not child.host_children:
                self._push_host(child)  # re-queued at its new access time
            cl = len(child.key)
            if n - pos >= cl and key.startswith(child.key, pos):
                pos += cl
                cur = child
                continue
            common = common_prefix_bytes(key, pos, child.key, min(cl, n - pos))
            pos += common - common % pb
            break
        host = pos // TOKEN_BYTES - device_tokens
        return host if host >= self.settings.load_back_threshold else 0

    def peek_prefix(self, key: bytes, namespace: str = "") -> int:
        """What a request would find cached, device then host (the host part only from
        ``load_back_threshold`` tokens, as it would be loaded); changes nothing."""
        key = self._aligned(key)
        root = self._roots.get(namespace)
        if root is None:
            return 0
        node = _h(root)
        pos, n, pb = 0, len(key), self._page_bytes
        on_device = True
        device = 0
        while pos < n:
            page = key[pos : pos + pb]
            child = node.children.get(page) if on_device else None
            if child is None:
                if on_device:
                    on_device, device = False, pos
                child = node.host_children.get(page)
                if child is None:
                    break
            ck = child.key
            if n - pos >= len(ck) and key.startswith(ck, pos):
                pos += len(ck)
                node = _h(child)
                continue
            common = common_prefix_bytes(key, pos, ck, min(len(ck), n - pos))
            pos += common - common % pb
            break
        if on_device:
            return pos // TOKEN_BYTES
        host = (pos - device) // TOKEN_BYTES
        keep = host if host >= self.settings.load_back_threshold else 0
        return device // TOKEN_BYTES + keep

    # ------------------------------------------------------------------ load back
    def load_back(
        self, node: TreeNode, key: bytes, device_tokens: int, host_tokens: int
    ) -> TreeNode:
        """Bring the ``host_tokens`` host-only tokens of ``key`` after ``node`` (the device
        match's end, locked by the caller) back to the device; return the node now ending
        the match. Allocates their device slots (evicting); the caller checked the room."""
        key = self._aligned(key)
        path = self._host_path(_h(node), key, device_tokens * TOKEN_BYTES, host_tokens)
        for h in path:
            self._pinned.add(id(h))
        try:
            self.alloc(host_tokens)
        finally:
            self._pinned.clear()
        end: TreeNode = node
        for h in path:
            self._revive(h)
            end = h
        if self.settings.write_back:
            for h in path:
                self._duplicates[id(h)] = h
        self._touched(end)
        return end

    def _host_path(self, node: HostNode, key: bytes, pos: int, tokens: int) -> list[HostNode]:
        """The host-only nodes covering ``tokens`` of ``key`` from byte ``pos`` on, the last
        one split at the end of the range."""
        end = pos + tokens * TOKEN_BYTES
        path: list[HostNode] = []
        while pos < end:
            child = node.host_children[key[pos : pos + self._page_bytes]]
            if len(child.key) > end - pos:
                child = self._split_host(child, end - pos)
            path.append(child)
            pos += len(child.key)
            node = child
        return path

    def _revive(self, h: HostNode) -> None:
        """``h`` (host-only, its slots already allocated privately) is on the device again."""
        parent = _h(h.parent) if h.parent is not None else None
        assert parent is not None and h.evicted
        page = h.key[: self._page_bytes]
        del parent.host_children[page]
        parent.children[page] = h
        h.evicted = False
        h.last_access = self._clock
        self._num_nodes += 1
        self._host_nodes -= 1
        n = len(h.key) // TOKEN_BYTES
        self.private -= n
        self.evictable += n
        if self.listener is not None:
            self.listener.on_stored(h)

    # ------------------------------------------------------------------ insert
    def insert_path(
        self,
        key: bytes,
        namespace: str = "",
        *,
        allocated: bool = False,
        inserted_len: int = 0,
    ) -> tuple[int, TreeNode]:
        """As :meth:`RadixCache.insert_path`; host-only nodes the key runs through come back
        to the device with the caller's KV (not counted as already cached), and the inserted
        path's hits may copy nodes to the host (write-through policies)."""
        key = self._aligned(key)
        if not allocated:
            prefix, node = self.match_prefix(key, namespace)
            need = len(key) // TOKEN_BYTES - prefix
            if need == 0:
                self._count_hits(node, inserted_len)
                return prefix, node
            self.inc_lock(node)
            try:
                self.alloc(need)
            finally:
                self.dec_lock(node)
        revived = self._revive_for_insert(key, namespace)
        existing, node = super().insert_path(key, namespace, allocated=True)
        self._count_hits(node, inserted_len)
        return existing - revived, node

    def _revive_for_insert(self, key: bytes, namespace: str) -> int:
        """Bring back the host-only nodes ``key`` runs through; their tokens."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        node = _h(root)
        pos, n, pb = 0, len(key), self._page_bytes
        revived = 0
        while pos < n:
            page = key[pos : pos + pb]
            child = node.children.get(page)
            if child is not None:
                if n - pos >= len(child.key) and key.startswith(child.key, pos):
                    pos += len(child.key)
                    node = _h(child)
                    continue
                break  # diverges or ends inside a device node: nothing host-only below
            host = node.host_children.get(page)
            if host is None:
                break
            common = common_prefix_bytes(key, pos, host.key, min(len(host.key), n - pos))
            common -= common % pb
            if common < len(host.key):
                host = self._split_host(host, common)
            self._revive(host)
            if self.settings.write_back:
                self._duplicates[id(host)] = host
            revived += common // TOKEN_BYTES
            pos += common
            node = host
        return revived

    def _count_hits(self, end: TreeNode, inserted_len: int) -> None:
        """SGLang's hit counting on insert: one hit per node ending past ``inserted_len``;
        a node reaching the policy's threshold is copied with its un-copied ancestors."""
        if self.settings.write_back:
            return
        path: list[HostNode] = []
        cur: TreeNode | None = end
        while cur is not None and cur.parent is not None:
            path.append(_h(cur))
            cur = cur.parent
        threshold = self.settings.write_through_threshold
        node_end = 0
        for node in reversed(path):
            node_end += len(node.key) // TOKEN_BYTES
            if node_end <= inserted_len:
                continue
            node.hit_count += 1
            if not node.backuped and node.hit_count >= threshold:
                self._backup_chain(node)

    def _backup_chain(self, node: HostNode) -> None:
        chain = [node]
        cur = node.parent
        while cur is not None and cur.parent is not None and not _h(cur).backuped:
            chain.append(_h(cur))
            cur = cur.parent
        copied = 0
        for target in reversed(chain):
            if not self._backup(target):
                break
            copied += target.num_tokens
        if copied and self.on_transfer is not None:
            self.on_transfer("backup", copied, self.settings.copy_s(copied))

    def _backup(self, node: HostNode) -> bool:
        """Copy ``node`` (on the device) to the host if room can be made; counted."""
        n = node.num_tokens
        if self.host_available < n and not self._make_host_room(n):
            return False
        node.backuped = True
        self.host_used += n
        self.counters.backup_tokens += n
        self.counters.backup_bytes += n * self.settings.kv_bytes_per_token
        if self._host_stored is not None:
            self._host_stored(node)
        return True

    # ------------------------------------------------------------------ splits
    def _split(self, child: TreeNode, at: int) -> TreeNode:
        upper = _h(super()._split(child, at))
        lower = _h(child)
        upper.backuped = lower.backuped
        upper.hit_count = lower.hit_count
        if id(lower) in self._duplicates:
            self._duplicates[id(upper)] = upper
        return upper

    def _split_host(self, child: HostNode, at: int) -> HostNode:
        """Cut a host-only node's edge after ``at`` bytes; return the new upper node."""
        parent = _h(child.parent) if child.parent is not None else None
        assert parent is not None
        pb = self._page_bytes
        upper = HostNode(child.key[:at], parent, child.namespace)
        upper.evicted = True
        upper.backuped = True
        upper.hit_count = child.hit_count
        upper.last_access = child.last_access
        parent.host_children[child.key[:pb]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.host_children[child.key[:pb]] = child
        self._host_nodes += 1
        on_split = getattr(self.listener, "on_split", None)
        if on_split is not None:
            on_split(upper, child)
        return upper

    # ------------------------------------------------------------------ device eviction
    def evict(self, num_tokens: int) -> int:
        """Evict LRU unlocked device leaves until ``num_tokens`` were freed: demoted to the
        host when backed up (copied first under write-back), else dropped."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            if t != node.last_access or not self._is_evictable_leaf(node):
                continue
            h = _h(node)
            if not h.backuped and self.settings.write_back and self._backup(h):
                seconds = self.settings.copy_s(h.num_tokens)  # the scheduler waits for it
                self._stall_s += seconds
                if self.on_transfer is not None:
                    self.on_transfer("backup", h.num_tokens, seconds)
            n = h.num_tokens
            if h.backuped:
                self._demote(h)
            else:
                self._drop(h)
            freed += n
            self.evictable -= n
            self.available += n
            parent = h.parent
            assert parent is not None
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                self._push(parent)
        self.evicted_total += freed
        return freed

    def _demote(self, h: HostNode) -> None:
        if self.listener is not None:
            self.listener.on_removed(h)
        parent = _h(h.parent) if h.parent is not None else None
        assert parent is not None
        page = h.key[: self._page_bytes]
        del parent.children[page]
        parent.host_children[page] = h
        h.evicted = True
        self._num_nodes -= 1
        self._host_nodes += 1
        self._duplicates.pop(id(h), None)
        if not h.host_children:
            self._push_host(h)

    def _drop(self, h: HostNode) -> None:
        """Remove a device leaf that has no host copy, with its host-only subtree."""
        for desc in reversed(list(_host_subtree(h))):
            self._forget_host(desc)
        h.host_children.clear()
        if self.listener is not None:
            self.listener.on_removed(h)
        parent = h.parent
        assert parent is not None
        del parent.children[h.key[: self._page_bytes]]
        h.evicted = True
        self._num_nodes -= 1
        self._duplicates.pop(id(h), None)
        reason = {
            "write_through": "write_through_unbacked_eviction",
            "write_back": "host_pressure",
        }.get(self.settings.write_policy)
        if reason is not None:
            dropped = self.counters.dropped_tokens
            dropped[reason] = dropped.get(reason, 0) + h.num_tokens

    def _forget_host(self, h: HostNode) -> None:
        """Free a host-only node's host copy (its children are gone already)."""
        if self._host_removed is not None:
            self._host_removed(h)
        self.host_used -= h.num_tokens
        h.backuped = False
        self._host_nodes -= 1

    # ------------------------------------------------------------------ host eviction
    def _push_host(self, h: HostNode) -> None:
        self._heap_seq += 1
        heapq.heappush(self._host_heap, (h.last_access, self._heap_seq, h))
        if len(self._host_heap) > 4 * self._host_nodes + 1024:
            self._host_heap = [e for e in self._host_heap if self._host_leaf(e[2], e[0])]
            heapq.heapify(self._host_heap)

    def _host_leaf(self, h: HostNode, t: int) -> bool:
        return (
            t == h.last_access
            and h.evicted
            and h.backuped
            and not h.host_children
            and h.parent is not None
            and id(h) not in self._pinned
        )

    def _make_host_room(self, need: int) -> bool:
        """Free host copies until ``need`` tokens fit: under write-back, copies of nodes
        still on the device first (sparing device leaves, then not), then host-only LRU
        leaves. Whether they fit."""
        if self.settings.write_back:
            for spare_leaves in (True, False):
                for key, node in list(self._duplicates.items()):
                    if self.host_available >= need:
                        return True
                    if node.evicted or not node.backuped:
                        del self._duplicates[key]
                        continue
                    if spare_leaves and self._is_evictable_leaf(node):
                        continue
                    del self._duplicates[key]
                    if self._host_removed is not None:
                        self._host_removed(node)
                    node.backuped = False
                    self.host_used -= node.num_tokens
                    self.counters.host_evicted_tokens += node.num_tokens
        heap = self._host_heap
        while self.host_available < need and heap:
            t, _, h = heapq.heappop(heap)
            if not self._host_leaf(h, t):
                continue
            parent = _h(h.parent) if h.parent is not None else None
            assert parent is not None
            del parent.host_children[h.key[: self._page_bytes]]
            self._forget_host(h)
            self.counters.host_evicted_tokens += h.num_tokens
            if parent.evicted and parent.backuped and not parent.host_children:
                self._push_host(parent)
        return self.host_available >= need

    # ------------------------------------------------------------------ reset and checks
    def reset(self) -> None:
        """Drop both tiers (``/flush_cache``)."""
        super().reset()
        self.host_used = 0
        self._host_heap.clear()
        self._host_nodes = 0
        self._duplicates.clear()

    def iter_host_nodes(self) -> Iterator[HostNode]:
        """Every host-only node (tests)."""
        for node in self.iter_nodes():
            yield from _host_subtree(_h(node))
        for root in self._roots.values():
            yield from _host_subtree(_h(root))

    def check_invariants(self) -> None:
        super().check_invariants()
        used = host_only = 0
        for node in self.iter_nodes():
            h = _h(node)
            assert not h.evicted
            used += h.num_tokens if h.backuped else 0
        for h in self.iter_host_nodes():
            host_only += 1
            assert h.evicted and h.backuped and not h.children, h
            used += h.num_tokens
        assert used == self.host_used, (used, self.host_used)
        assert host_only == self._host_nodes, (host_only, self._host_nodes)
        assert 0 <= self.host_used <= self.host_capacity, (self.host_used, self.host_capacity)


def _host_subtree(node: HostNode) -> Iterator[HostNode]:
    """The host-only nodes below ``node``, parents before children."""
    stack = list(node.host_children.values())
    while stack:
        h = stack.pop()
        yield h
        stack.extend(h.host_children.values())
