"""Token-level radix tree over a KV pool of fixed capacity, as SGLang's ``RadixCache``.

What it models (SGLANG_API.md §5):

* keys are token ids, matched and inserted in whole pages (``page_size``, default 1);
* edges are compressed: one node holds a run of tokens; children are keyed by their
  first page, so a lookup costs one dict probe per node on the path;
* running requests hold lock references on their path (``inc_lock`` / ``dec_lock``), and a
  locked node is never evicted;
* the pool has ``capacity`` token slots.  Slots are either free (``available``), held by the
  tree (``evictable`` when unlocked, ``protected`` when locked) or held privately by running
  requests outside the tree (``private``: KV computed but not inserted yet).  Invariant:
  ``available + evictable + protected + private == capacity``;
* eviction is on demand only: ``alloc(n)`` evicts least-recently-used unlocked *leaves*
  (whole nodes, like SGLang) until ``n`` slots are free.  A parent left childless and
  unlocked becomes a leaf and competes by its own last-access time.

Representation and cost.  A key is ``bytes`` with 4 bytes per token (native ``uint32``,
see :func:`encode_tokens`): comparisons are ``memcmp`` (``bytes.startswith`` with an
offset, no copy), the divergence point inside an edge is found by a binary search over
``startswith`` windows (O(edge length) bytes touched, O(log n) Python steps), and a stored
token costs 4 bytes instead of a list slot plus an int object.  Match + insert of a
32,000-token prompt is a few tens of microseconds (``python -m loadtests.micro.simulator``).
Access times are a logical clock (one tick per match or insert), which orders LRU
exactly and deterministically.  Evictable leaves sit in a heap with lazy invalidation.

Namespaces (``cache_salt``, ``extra_key``, LoRA adapter) get separate roots, so requests in
different namespaces never share a prefix; they share the pool and the LRU.

KV-event hook: an optional :class:`CacheListener` is told when a node is stored, before a
node is evicted, and when everything is cleared, which is what SGLang's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events are made from.  Nodes have
a free ``meta`` slot for the listener's own data (e.g. the node's last block hash).
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

_TOKEN_TYPECODE = "I" if array.array("I").itemsize == 4 else "L"
TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1


def encode_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids → radix key (4 bytes per token, native byte order)."""
    arr = array.array(_TOKEN_TYPECODE)
    if isinstance(tokens, list):
        arr.fromlist(tokens)
    else:
        arr.extend(tokens)
    return arr.tobytes()


def decode_tokens(key: bytes) -> list[int]:
    """Radix key → token ids."""
    arr = array.array(_TOKEN_TYPECODE)
    arr.frombytes(key)
    return arr.tolist()


def common_prefix_bytes(a: bytes, a_off: int, b: bytes, limit: int) -> int:
    """Length in bytes of the common prefix of ``a[a_off:a_off+limit]`` and ``b[:limit]``."""
    if a.startswith(b if limit == len(b) else b[:limit], a_off):
        return limit
    lo, hi = 0, limit - 1  # invariant: a[a_off:a_off+lo] == b[:lo]; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a.startswith(b[lo:mid], a_off + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class CacheFullError(RuntimeError):
    """An allocation cannot be satisfied even after evicting every unlocked leaf."""


class TreeNode:
    """One compressed edge of the tree: ``key`` holds its tokens (a whole number of pages)."""

    __slots__ = (
        "children",
        "evicted",
        "key",
        "last_access",
        "lock_ref",
        "meta",
        "namespace",
        "parent",
    )

    def __init__(self, key: bytes, parent: TreeNode | None, namespace: str) -> None:
        self.key = key
        self.parent = parent
        self.namespace = namespace
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.evicted = False
        self.meta: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    def token_ids(self) -> list[int]:
        return decode_tokens(self.key)

    def depth_tokens(self) -> int:
        """Tokens on the path from the root to the start of this node."""
        depth = 0
        node = self.parent
        while node is not None:
            depth += len(node.key)
            node = node.parent
        return depth // TOKEN_BYTES

    def path_key(self) -> bytes:
        """The whole key from the root through the end of this node."""
        parts: list[bytes] = []
        node: TreeNode | None = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    def __repr__(self) -> str:
        return f"TreeNode(tokens={self.num_tokens}, lock={self.lock_ref}, t={self.last_access})"


class CacheListener(Protocol):
    """Receives tree changes; the seam for SGLang-style KV events (not implemented here)."""

    def on_stored(self, node: TreeNode) -> None:
        """A new node was created by an insert (its parent chain gives its prefix)."""

    def on_removed(self, node: TreeNode) -> None:
        """``node`` (a leaf) is about to be evicted."""

    def on_cleared(self) -> None:
        """The whole tree was dropped (flush)."""

    # Optional: ``on_split(upper, lower)`` is called, when the listener defines it, after
    # a node was cut in two (``upper`` is new and holds the first part of the edge).


class RadixCache:
    """The radix tree plus the KV pool accounting of one worker (see module docstring)."""

    node_class: type[TreeNode] = TreeNode  # a tiered cache's nodes carry more

    def __init__(
        self,
        capacity: int,
        page_size: int = 1,
        listener: CacheListener | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.capacity = capacity
        self.page_size = page_size
        self.listener = listener
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[str, TreeNode] = {}
        self._clock = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._heap_seq = 0
        self._num_nodes = 0
        self.available = capacity
        self.evictable = 0
        self.protected = 0
        self.private = 0
        self.evicted_total = 0  # tokens evicted since start

    # ------------------------------------------------------------------ counters
    @property
    def tree_tokens(self) -> int:
        return self.evictable + self.protected

    @property
    def used(self) -> int:
        """Slots held by live requests: ``capacity - available - evictable``."""
        return self.capacity - self.available - self.evictable

    # ------------------------------------------------------------------ pool
    def can_alloc(self, n: int) -> bool:
        return n <= self.available + self.evictable

    def alloc(self, n: int) -> None:
        """Take ``n`` private slots, evicting LRU unlocked leaves if the free pool is short."""
        if n > self.available:
            if n > self.available + self.evictable:
                raise CacheFullError(
                    f"need {n} slots, {self.available} free + {self.evictable} evictable"
                )
            self.evict(n - self.available)
            if n > self.available:  # unreachable while the counters are consistent
                raise CacheFullError(f"eviction freed too little for {n} slots")
        self.available -= n
        self.private += n

    def free(self, n: int) -> None:
        """Return ``n`` private slots to the free pool."""
        if n < 0 or n > self.private:
            raise ValueError(f"cannot free {n} of {self.private} private slots")
        self.private -= n
        self.available += n

    # ------------------------------------------------------------------ tree
    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self.node_class(b"", None, namespace)
            root.lock_ref = 1  # roots are never evictable
            self._roots[namespace] = root
        return root

    def _aligned(self, key: bytes) -> bytes:
        extra = len(key) % self._page_bytes
        return key[: len(key) - extra] if extra else key

    def match_prefix(self, key: bytes, namespace: str = "") -> tuple[int, TreeNode]:
        """Longest cached page-aligned prefix of ``key``: ``(tokens, last node)``.

        Refreshes the access time along the path. A match that ends inside an edge splits
        that node, so the returned node ends exactly at the match (and can be locked).
        """
        key = self._aligned(key)
        node, pos = self._walk(key, namespace)
        self._touched(node)
        return pos // TOKEN_BYTES, node

    def _walk(self, key: bytes, namespace: str) -> tuple[TreeNode, int]:
        """Follow ``key`` from the root, touching the path; split where it diverges mid-edge.

        Returns the deepest node on the path and the matched length in bytes.
        """
        self._clock += 1
        tick = self._clock
        node = self._root(namespace)
        node.last_access = tick
        pos, n, pb = 0, len(key), self._page_bytes
        while pos < n:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            cl = len(ck)
            child.last_access = tick
            if n - pos >= cl and key.startswith(ck, pos):
                pos += cl
                node = child
                continue
            common = common_prefix_bytes(key, pos, ck, min(cl, n - pos))
            common -= common % pb  # >= pb: the child was found by its first page
            node = self._split(child, common)
            self._touched(child)  # SGLang refreshes the split-off lower part too
            pos += common
            break
        return node, pos

    def peek_prefix(self, key: bytes, namespace: str = "") -> int:
        """Length of the cached page-aligned prefix of ``key``; changes nothing."""
        key = self._aligned(key)
        root = self._roots.get(namespace)
        if root is None:
            return 0
        node = root
        pos, n, pb = 0, len(key), self._page_bytes
        while pos < n:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            cl = len(ck)
            if n - pos >= cl and key.startswith(ck, pos):
                pos += cl
                node = child
                continue
            common = common_prefix_bytes(key, pos, ck, min(cl, n - pos))
            pos += common - common % pb
            break
        return pos // TOKEN_BYTES

    def insert(self, key: bytes, namespace: str = "", *, allocated: bool = False) -> int:
        """Insert ``key`` (page-aligned down); return how many tokens were already cached.

        See :meth:`insert_path`.
        """
        return self.insert_path(key, namespace, allocated=allocated)[0]

    def insert_path(
        self,
        key: bytes,
        namespace: str = "",
        *,
        allocated: bool = False,
        inserted_len: int = 0,
    ) -> tuple[int, TreeNode]:
        """Insert ``key`` (page-aligned down): ``(tokens already cached, node ending the key)``.

        ``inserted_len``: tokens of ``key`` the caller inserted before (SGLang's
        ``cache_inserted_len``); this cache ignores it, a tiered one counts hits past it.

        ``allocated=True``: the caller already holds the new tokens' slots privately (it
        computed their KV); they move from ``private`` to the tree. The caller must
        ``free`` its own slots for the returned already-cached part it also computed.
        ``allocated=False``: slots for the new tokens are allocated here (evicting if
        needed; :class:`CacheFullError` if impossible, with nothing inserted).
        """
        key = self._aligned(key)
        if not allocated:
            prefix, node = self.match_prefix(key, namespace)
            need = (len(key) // TOKEN_BYTES) - prefix
            if need == 0:
                return prefix, node
            self.inc_lock(node)  # the matched path must survive the eviction below
            try:
                self.alloc(need)
            finally:
                self.dec_lock(node)
        node, pos = self._walk(key, namespace)
        n, pb = len(key), self._page_bytes
        existing = pos // TOKEN_BYTES
        if pos < n:
            new = self.node_class(key[pos:], node, namespace)
            new.last_access = self._clock
            node.children[key[pos : pos + pb]] = new
            self._num_nodes += 1
            new_tokens = (n - pos) // TOKEN_BYTES
            self.private -= new_tokens
            self.evictable += new_tokens
            self._push(new)
            if self.listener is not None:
                self.listener.on_stored(new)
            return existing, new
        self._touched(node)
        return existing, node

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child``'s edge after ``at`` bytes; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = self.node_class(child.key[:at], parent, child.namespace)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[child.key[: self._page_bytes]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        self._num_nodes += 1
        on_split = getattr(self.listener, "on_split", None)  # optional hook (KV events)
        if on_split is not None:
            on_split(upper, child)
        return upper

    # ------------------------------------------------------------------ locks
    def inc_lock(self, node: TreeNode) -> None:
        """Protect the path root→``node`` from eviction (one reference per running request)."""
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.lock_ref == 0:
                delta += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent
        delta //= TOKEN_BYTES
        self.evictable -= delta
        self.protected += delta

    def dec_lock(self, node: TreeNode) -> None:
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.lock_ref <= 0:
                raise ValueError("dec_lock on an unlocked node")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                delta += len(cur.key)
                if not cur.children:
                    self._push(cur)
            cur = cur.parent
        delta //= TOKEN_BYTES
        self.evictable += delta
        self.protected -= delta

    # ------------------------------------------------------------------ eviction
    def _touched(self, node: TreeNode) -> None:
        if not node.children and node.lock_ref == 0 and node.parent is not None:
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, node))
        if len(self._heap) > 4 * self._num_nodes + 1024:
            self._compact_heap()

    @staticmethod
    def _is_evictable_leaf(node: TreeNode) -> bool:
        return (
            not node.evicted
            and not node.children
            and node.lock_ref == 0
            and node.parent is not None
        )

    def _compact_heap(self) -> None:
        live: dict[int, tuple[int, int, TreeNode]] = {}
        for entry in self._heap:
            t, _, node = entry
            if t == node.last_access and self._is_evictable_leaf(node):
                live[id(node)] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unlocked leaves until at least ``num_tokens`` were freed; return freed."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            if t != node.last_access or not self._is_evictable_leaf(node):
                continue
            if self.listener is not None:
                self.listener.on_removed(node)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self._page_bytes]]
            node.evicted = True
            self._num_nodes -= 1
            n = len(node.key) // TOKEN_BYTES
            freed += n
            self.evictable -= n
            self.available += n
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                self._push(parent)
        self.evicted_total += freed
        return freed

    def reset(self) -> None:
        """Drop the whole tree (``/flush_cache``). Locked nodes must not exist."""
        if self.protected:
            raise RuntimeError("cannot reset the cache while requests hold locks")
        self.available += self.evictable
        self.evictable = 0
        self._roots.clear()
        self._heap.clear()
        self._num_nodes = 0
        if self.listener is not None:
            self.listener.on_cleared()

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node (for tests and debugging)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def namespaces(self) -> Sequence[str]:
        return list(self._roots)

    def check_invariants(self) -> None:
        """Recount everything from the tree; raise AssertionError on any mismatch (tests)."""
        evictable = protected = nodes = 0
        for node in self.iter_nodes():
            nodes += 1
            assert node.key and len(node.key) % self._page_bytes == 0, "unaligned edge"
            assert node.parent is not None
            assert node.parent.children.get(node.key[: self._page_bytes]) is node
            assert node.last_access <= node.parent.last_access or node.parent.parent is None
            locked_children = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= locked_children, "child locked more than parent"
            if node.lock_ref:
                protected += node.num_tokens
            else:
                evictable += node.num_tokens
        assert nodes == self._num_nodes, (nodes, self._num_nodes)
        assert evictable == self.evictable, (evictable, self.evictable)
        assert protected == self.protected, (protected, self.protected)
        assert self.available >= 0 and self.private >= 0
        total = self.available + self.evictable + self.protected + self.private
        assert total == self.capacity, (total, self.capacity)
