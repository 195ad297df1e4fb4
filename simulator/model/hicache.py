"""HiCache's host tier: its settings, as SGLang 0.5.23 resolves them, and its link.

SGLang's ``--enable-hierarchical-cache`` keeps a second KV pool in pinned host memory under
the GPU's radix cache (``mem_cache/unified_radix_cache.py``, ``unified_cache/
unified_tree_core.py``, ``managers/cache_controller.py``). What the simulator models of it,
read from that source (the tree itself is :mod:`simulator.model.hiradix_cache`):

* **Size** (``pool_host/base.py``): ``--hicache-size`` GB (an int, 0 = unset) gives
  ``size * 1e9 // bytes_per_token`` tokens and overrides ``--hicache-ratio`` (host tokens =
  device tokens x ratio, default 2.0 in the default ``cache`` host memory mode); then
  ``size // page + 1`` pages (SGLang adds one padding page to an independent pool), all
  usable. SGLang 0.5.23 also shrinks the *default* ratio until the pools fit 80 % of the
  machine's free memory (``--hicache-host-memory-fraction``); a simulated host has no
  memory limit, so the ratio stays 2.0.
* **Write policy** (``--hicache-write-policy``, default ``write_through``): when a node's
  KV is copied to the host. ``write_through``: when it is inserted (its hit count reaches
  1); ``write_through_selective``: when a second request inserts through it (hit count 2);
  ``write_back``: only when the GPU evicts it, synchronously (the scheduler waits for the
  copy). A write-through copy goes with its not-yet-copied ancestors, top down, and stops
  at the first that finds no host room.
* **Link** (``--hicache-io-backend``, the simulator's ``hicache_link``): loads and backups
  cost ``fixed latency + tokens x bytes per token / effective bandwidth``
  (:data:`simulator.model.transfer.HOST_LINK_PROFILES`); the ``direct`` I/O backend is
  :data:`~simulator.model.transfer.DIRECT_IO_SLOWDOWN` times slower than ``kernel``.
* **Load back**: a host hit shorter than ``load_back_threshold`` (10 tokens in 0.5.23) is
  recomputed instead of loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.model.transfer import DIRECT_IO_SLOWDOWN, TransferProfile

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("kernel", "direct")
DEFAULT_HICACHE_RATIO = 2.0  # SGLang's default in the "cache" host memory mode
LOAD_BACK_THRESHOLD = 10  # UnifiedRadixCache.load_back_threshold


def host_pool_tokens(
    device_tokens: int, page_size: int, ratio: float | None, size_gb: int, kv_bytes_per_token: int
) -> int:
    """The host pool's capacity in tokens, as ``HostKVCache.__init__`` sizes it."""
    if size_gb > 0:
        size = int(size_gb * 1e9 // kv_bytes_per_token)
    else:
        size = int(device_tokens * (DEFAULT_HICACHE_RATIO if ratio is None else ratio))
    return (size // page_size + 1) * page_size


def check_hicache(write_policy: str, io_backend: str, ratio: float | None, size_gb: int) -> None:
    """SGLang's choices and the simulator's bounds; ``ValueError`` naming the flag."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, not {write_policy!r}"
        )
    if io_backend not in IO_BACKENDS:
        raise ValueError(
            f"hicache_io_backend must be one of {', '.join(IO_BACKENDS)}, not {io_backend!r}"
        )
    if ratio is not None and ratio <= 0:
        raise ValueError("hicache_ratio must be positive")
    if size_gb < 0:
        raise ValueError("hicache_size must be >= 0 (GB; 0: use hicache_ratio)")


@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """One worker's host tier, resolved (what :class:`simulator.model.hiradix_cache.
    HiRadixCache` is built from)."""

    host_tokens: int
    write_policy: str
    link: TransferProfile
    kv_bytes_per_token: int
    io_backend: str = "kernel"
    ratio: float = DEFAULT_HICACHE_RATIO  # as reported (/server_info)
    size_gb: int = 0
    load_back_threshold: int = LOAD_BACK_THRESHOLD

    @property
    def write_back(self) -> bool:
        return self.write_policy == "write_back"

    @property
    def write_through_threshold(self) -> int:
        """Hits (inserts through a node) that trigger its copy to the host: SGLang sets 1
        for ``write_through`` and 2 otherwise (``write_back`` never copies on insert)."""
        return 1 if self.write_policy == "write_through" else 2

    def copy_s(self, tokens: int) -> float:
        """Modelled seconds to move ``tokens`` tokens' KV over the link (one direction,
        one merged operation), 0 for none."""
        if tokens <= 0:
            return 0.0
        seconds = self.link.bytes_s(tokens * self.kv_bytes_per_token)
        if self.io_backend == "direct":
            seconds *= DIRECT_IO_SLOWDOWN
        return self.link.fixed_latency_s + seconds
