"""Exact mode's wire format: KV-event batches and ``kv_events`` descriptors (SGLANG_API.md §4).

* :func:`decode_batch` reads an ``EventBatch`` in either encoding (0.5.23 tagged maps,
  ≤0.5.18 tagged arrays), ignoring unknown keys, unknown events and trailing elements;
  a block event's ``medium`` (``"GPU"``, HiCache's host copies ``"CPU_PINNED"``, L3's
  ``"DISK"`` / ``"EXTERNAL"``; absent before 0.5.9 and when null) is kept as
  :data:`GPU`, :data:`HOST` or :data:`OTHER` (:func:`medium_of`);
* :class:`Descriptor` is a worker's ``kv_events`` entry of ``/server_info``: where its
  publisher and replay endpoints listen, its topic, block size and DP size;
  :func:`same_host` says whether that host is the worker URL's own;
* :data:`SEQ` and :data:`END_SEQ` frame sequence numbers (big-endian u64) on the live
  stream and in replay answers.

Pure decoding: no I/O, no state.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

END_SEQ = 2**64 - 1  # the sequence number that ends a replay answer
SEQ = struct.Struct(">Q")  # a sequence-number frame


# Where a block event's copy is (SGLang's ``StorageMedium``): the GPU (also every event
# without a medium), the host memory of HiCache (``CPU_PINNED``; ``CPU`` accepted), or a
# storage tier the gateway does not follow (``DISK``, ``EXTERNAL``, anything else).
GPU, HOST, OTHER = "gpu", "host", "other"
_HOST_MEDIA = frozenset({"CPU_PINNED", "CPU"})


def medium_of(raw: object) -> str:
    """A wire ``medium`` as :data:`GPU`, :data:`HOST` or :data:`OTHER`."""
    if raw is None:
        return GPU
    name = raw.upper() if isinstance(raw, str) else ""
    if name == "GPU":
        return GPU
    return HOST if name in _HOST_MEDIA else OTHER


@dataclass(slots=True)
class Stored:
    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None
    lora_name: str | None = None
    medium: str = GPU  # GPU, HOST or OTHER (:func:`medium_of`)


@dataclass(slots=True)
class Removed:
    block_hashes: list[int]
    medium: str = GPU


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _event_from_map(raw: Mapping[str, Any]) -> Event | None:
    kind = raw.get("type")
    if kind in ("BlockStored", "BlockStoredWithMetadata"):
        return Stored(
            list(raw.get("block_hashes") or []),
            raw.get("parent_block_hash"),
            list(raw.get("token_ids") or []),
            int(raw.get("block_size") or 0),
            raw.get("cache_salt"),
            raw.get("lora_name"),
            medium_of(raw.get("medium")),
        )
    if kind == "BlockRemoved":
        return Removed(list(raw.get("block_hashes") or []), medium_of(raw.get("medium")))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _event_from_array(raw: Sequence[Any]) -> Event | None:
    kind = raw[0] if raw else None
    if kind in ("BlockStored", "BlockStoredWithMetadata") and len(raw) >= 5:
        meta = next((x for x in raw[7:] if isinstance(x, dict)), {})
        medium = medium_of(raw[6] if len(raw) > 6 else None)
        return Stored(
            list(raw[1]), raw[2], list(raw[3]), int(raw[4]), meta.get("cache_salt"), None, medium
        )
    if kind == "BlockRemoved" and len(raw) >= 2:
        return Removed(list(raw[1]), medium_of(raw[2] if len(raw) > 2 else None))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[Event], int]:
    """``[ts, events, dp_rank]`` in either encoding; unknown events are skipped."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, raw_events = float(body[0]), body[1]
    rank = body[2] if len(body) > 2 and isinstance(body[2], int) else 0
    events: list[Event] = []
    for raw in raw_events:
        event = _event_from_map(raw) if isinstance(raw, dict) else _event_from_array(raw)
        if event is not None:
            events.append(event)
    return ts, events, rank


MAX_DP_SIZE = 1024  # data-parallel ranks followed per worker, at most


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A worker's ``kv_events`` descriptor, with the wildcard host substituted."""

    host: str
    port_base: int
    topic: str
    block_size: int
    dp_size: int
    replay_port_base: int | None

    @classmethod
    def parse(cls, raw: Mapping[str, Any], worker_url: str) -> Descriptor | None:
        if not raw or raw.get("publisher") != "zmq" or raw.get("endpoint_port_base") is None:
            return None
        host = str(raw.get("endpoint_host") or "*")
        if host in ("*", "0.0.0.0", "::", ""):
            host = urlsplit(worker_url).hostname or "127.0.0.1"
        replay = raw.get("replay_endpoint_port_base")
        desc = cls(
            host,
            int(raw["endpoint_port_base"]),
            str(raw.get("topic") or ""),
            int(raw.get("block_size") or 1),
            int(raw.get("dp_size") or 1),
            int(replay) if replay is not None else None,
        )
        # a worker's word: one feed (a socket and a task) per rank, so bound it all
        ports = [desc.port_base]
        if desc.replay_port_base is not None:
            ports.append(desc.replay_port_base)
        if not (
            1 <= desc.dp_size <= MAX_DP_SIZE
            and all(p >= 1 and p + desc.dp_size - 1 <= 65535 for p in ports)
            and desc.block_size >= 1
            and 0 < len(host) <= 253
            and host.isprintable()
            and " " not in host
        ):
            raise ValueError("kv_events descriptor out of range")
        return desc


def _host_key(host: str) -> str | ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` compared as an address when it is one (``::1`` is ``0:0::1``), else as a
    name (case, a trailing dot and IPv6 brackets ignored); "loopback" for every spelling
    of this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return "loopback"
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return "loopback" if address.is_loopback else address


def same_host(host: str, worker_url: str) -> bool:
    """Whether a descriptor's host (wildcard already substituted) names the worker URL's
    own host: the same name or address, or both this machine. Nothing is resolved: a
    name and an address are different hosts here (the allow-list, which resolves, may
    still admit the name)."""
    worker = urlsplit(worker_url).hostname
    return bool(worker) and _host_key(host) == _host_key(worker or "")
