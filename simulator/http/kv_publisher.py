"""SGLang-style KV-cache events for the simulated worker (SGLANG_API.md §4).

What a subscriber sees is what SGLang 0.5.23 publishes:

* ZMQ PUB, 3-frame messages ``[topic, seq (u64 big-endian), payload]``; ``seq`` counts
  from 0 at start, so it resets when the worker restarts;
* ``payload`` = msgpack ``[ts, events, dp_rank]``; events are tagged maps (0.5.23,
  default) or tagged arrays (≤0.5.18, ``legacy_array=True``);
* ``BlockStored`` when a radix node is created (after each prefill chunk and at finish),
  ``BlockRemoved`` for each evicted node (all its page hashes), ``AllBlocksCleared`` at
  start (queued until the first publish) and on ``/flush_cache``; splits emit nothing;
* ``medium`` ``"GPU"``, or ``"CPU_PINNED"`` (SGLang's ``StorageMedium.CPU``) for the
  HiCache host tier's copies: stored when a node's KV is copied to the host, removed when
  the host copy is freed (:mod:`simulator.model.hiradix_cache` says when);
* block hashes: SHA-256 chained per page (§4.4): ``d_0 = SHA256(LE_u32 tokens)``,
  ``d_i = SHA256(d_{i-1} || LE_u32 tokens)``, published as the first 8 bytes, big-endian
  signed. ``cache_salt`` seeds the chain with ``SHA256("sglang-cache-salt-v1\\0" + salt)``.
  LoRA / ``extra_key`` namespacing (``SHA256(seed || hash_be8)[:8]``) uses a seed of our
  own derivation: SGLang's ``kv_event_namespace_seed`` was not byte-verified;
* coalescing (§4.3): consecutive stores forming a parent chain with the same block size,
  salt and LoRA merge into one event; consecutive removes merge;
* the PUB socket binds or connects by SGLang 0.5.23's rule (``KVEventsConfig.binds``:
  ``"bind": true``, or a wildcard endpoint, binds; ``tcp://127.0.0.1:5557`` alone
  connects, and then a subscriber must bind that address);
* a replay ROUTER (§4.5, always bound) answering ``[id, b"", start_seq8]`` with every buffered batch
  ``seq >= start`` then the terminator ``seq8 = 2**64-1``.

Batching: the cache listener queues events; the first event of a model step schedules
one ``call_soon`` flush, so everything one step produced goes out as one batch after the
step (SGLang publishes per prefill batch; publishing per step is at least as prompt).
Sending is a non-blocking ``send_multipart`` on the event loop thread (PUB never blocks:
past the high-water mark it drops, as SGLang's does); msgpack encoding is the only cost.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import hashlib
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from simulator.config import KVEventsConfig
from simulator.model.radix_cache import TreeNode

END_SEQ = 2**64 - 1
SALT_PREFIX = b"sglang-cache-salt-v1\x00"
_NS_PREFIX = b"sglang-sim-kv-namespace-v1\x00"
_SEQ = struct.Struct(">Q")


# ---------------------------------------------------------------------- endpoints
def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with ``port + offset`` (ephemeral ``*``/``0`` stays ephemeral)."""
    head, _, port = endpoint.rpartition(":")
    if not head.startswith("tcp://") or port in ("*", "0"):
        return f"{head}:*" if head.startswith("tcp://") else endpoint
    return f"{head}:{int(port) + offset}"


def is_ephemeral(endpoint: str | None) -> bool:
    """A ``tcp://`` endpoint whose port is ``*`` or ``0`` (bound to any free port)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return False
    return endpoint.rpartition(":")[2] in ("*", "0")


def _endpoint(endpoint: str, offset: int, port: int | None) -> str:
    """``endpoint`` moved by ``offset``, or on ``port`` when one is given."""
    if port is None:
        return offset_endpoint(endpoint, offset)
    return f"{endpoint.rpartition(':')[0]}:{port}"


# ---------------------------------------------------------------------- hashing
def salt_seed(salt: str) -> bytes:
    """The chain seed of a salted request (§4.4)."""
    return hashlib.sha256(SALT_PREFIX + salt.encode()).digest()


def le_u32(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 words (the bytes SGLang hashes)."""
    arr = array.array("I" if array.array("I").itemsize == 4 else "L", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def page_digests(tokens: Sequence[int] | bytes, page_size: int, prev: bytes | None) -> list[bytes]:
    """SHA-256 chain over the full pages of ``tokens``, continuing from digest ``prev``.

    ``tokens`` may be given as little-endian u32 bytes already (a radix key on a
    little-endian machine), which saves packing them again.
    """
    data = tokens if isinstance(tokens, bytes) else le_u32(tokens)
    step = page_size * 4
    sha = hashlib.sha256
    out: list[bytes] = []
    for off in range(0, len(data) - len(data) % step, step):
        chunk = data[off : off + step]
        prev = sha(prev + chunk).digest() if prev is not None else sha(chunk).digest()
        out.append(prev)
    return out


def digest_to_hash(digest: bytes) -> int:
    """The published block hash: first 8 digest bytes, big-endian signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def namespace_seed(lora: str, extra_key: str) -> bytes | None:
    """Seed for LoRA / extra_key namespacing (our derivation; None when neither is set)."""
    if not lora and not extra_key:
        return None
    return hashlib.sha256(_NS_PREFIX + lora.encode() + b"\x00" + extra_key.encode()).digest()


def namespaced_hash(block_hash: int, seed: bytes) -> int:
    """``SHA256(seed || hash as 8-byte big-endian)[0:8]`` as a signed int64."""
    data = seed + block_hash.to_bytes(8, "big", signed=True)
    return digest_to_hash(hashlib.sha256(data).digest())


# ---------------------------------------------------------------------- events
GPU = "GPU"  # SGLang's StorageMedium.GPU (L1)
CPU_PINNED = "CPU_PINNED"  # StorageMedium.CPU (L2, HiCache's host tier)


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None
    lora_name: str | None = None
    medium: str = GPU


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: Event, legacy_array: bool = False) -> Any:
    """One event as msgpack-ready data: a tagged map (0.5.23) or a tagged array (≤0.5.18)."""
    if isinstance(event, BlockStored):
        if legacy_array:
            arr: list[Any] = ["BlockStored", event.block_hashes, event.parent_block_hash]
            arr += [event.token_ids, event.block_size, None, event.medium]
            if event.cache_salt is not None:
                arr.append({"cache_salt": event.cache_salt})
            return arr
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
        }
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        if event.lora_name is not None:
            out["lora_name"] = event.lora_name
        return out
    if isinstance(event, BlockRemoved):
        if legacy_array:
            return ["BlockRemoved", event.block_hashes, event.medium]
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return ["AllBlocksCleared"] if legacy_array else {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: Sequence[Event], dp_rank: int = 0, legacy_array: bool = False
) -> bytes:
    """``EventBatch`` = msgpack array ``[ts (float64), events, dp_rank]``."""
    body = [float(ts), [encode_event(e, legacy_array) for e in events], dp_rank]
    return msgpack.packb(body, use_bin_type=True, use_single_float=False)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- recorder
class EventRecorder:
    """The radix cache's listener: turns tree changes into coalesced events.

    ``node.meta`` holds the node's page digests (``list[bytes]``); a split hands the
    upper part's digests to the new node (:meth:`on_split`). ``on_pending`` is called
    when the first event is queued after a :meth:`take`.
    """

    def __init__(self, page_size: int, on_pending: Callable[[], None] | None = None) -> None:
        self.page_size = page_size
        self.on_pending = on_pending
        self._events: list[Event] = [AllBlocksCleared()]  # the startup reset, queued

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _queue(self, event: Event) -> None:
        events = self._events
        last = events[-1] if events else None
        if (
            isinstance(event, BlockStored)
            and isinstance(last, BlockStored)
            and (
                event.parent_block_hash == last.block_hashes[-1]
                and event.medium == last.medium
                and event.block_size == last.block_size
                and event.cache_salt == last.cache_salt
                and event.lora_name == last.lora_name
            )
        ):
            last.block_hashes.extend(event.block_hashes)
            last.token_ids.extend(event.token_ids)
            return
        if (
            isinstance(event, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and event.medium == last.medium
        ):
            last.block_hashes.extend(event.block_hashes)
            return
        events.append(event)
        if len(events) == 1 and self.on_pending is not None:
            self.on_pending()

    @staticmethod
    def _split_namespace(namespace: str) -> tuple[str, str, str]:
        if not namespace:
            return "", "", ""
        lora, extra, salt = namespace.split("\x1f")
        return lora, extra, salt

    def _published(self, digests: Sequence[bytes], namespace: str) -> list[int]:
        hashes = [digest_to_hash(d) for d in digests]
        lora, extra, _ = self._split_namespace(namespace)
        seed = namespace_seed(lora, extra)
        if seed is not None:
            hashes = [namespaced_hash(h, seed) for h in hashes]
        return hashes

    # CacheListener ----------------------------------------------------------
    def on_stored(self, node: TreeNode) -> None:
        tokens = node.token_ids()
        key = node.key if sys.byteorder == "little" else tokens  # radix keys are native u32
        node.meta = page_digests(key, self.page_size, self._chain_seed(node))
        self._queue(self._stored(node, tokens, GPU))

    def on_host_stored(self, node: TreeNode) -> None:
        """``node``'s KV was copied to the host tier (its digests are known already)."""
        self._queue(self._stored(node, node.token_ids(), CPU_PINNED))

    def _chain_seed(self, node: TreeNode) -> bytes | None:
        parent = node.parent
        if parent is None or parent.parent is None:  # hangs off a namespace root
            _, _, salt = self._split_namespace(node.namespace)
            return salt_seed(salt) if salt else None
        digest: bytes = parent.meta[-1]
        return digest

    def _stored(self, node: TreeNode, tokens: list[int], medium: str) -> BlockStored:
        parent = node.parent
        lora, _, salt = self._split_namespace(node.namespace)
        parent_hash = None
        if parent is not None and parent.parent is not None:
            parent_hash = self._published([parent.meta[-1]], node.namespace)[0]
        return BlockStored(
            self._published(node.meta, node.namespace),
            parent_hash,
            tokens,
            self.page_size,
            cache_salt=salt or None,
            lora_name=lora or None,
            medium=medium,
        )

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        digests: list[bytes] = lower.meta
        cut = upper.num_tokens // self.page_size
        upper.meta, lower.meta = digests[:cut], digests[cut:]

    def on_removed(self, node: TreeNode) -> None:
        self._queue(BlockRemoved(self._published(node.meta, node.namespace)))

    def on_host_removed(self, node: TreeNode) -> None:
        """``node``'s host copy was freed."""
        self._queue(BlockRemoved(self._published(node.meta, node.namespace), CPU_PINNED))

    def on_cleared(self) -> None:
        self._queue(AllBlocksCleared())


# ---------------------------------------------------------------------- publisher
def _bound_port(sock: zmq.Socket[Any]) -> int:
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rpartition(":")[2])


class KVEventPublisher:
    """One worker's PUB socket, replay buffer and replay ROUTER (see module docstring).

    ``offset`` is added to the configured ports (worker index in a simulated fleet, as
    SGLang adds the DP rank). ``close()`` must be called (it terminates the context).
    :meth:`bind` may come before :meth:`start` (a server with DP ranks binds them all
    before any publishes, :func:`simulator.http.sglang.dp.start_publishers`).
    """

    def __init__(
        self,
        config: KVEventsConfig,
        page_size: int,
        offset: int = 0,
        legacy_array: bool = False,
        dp_rank: int = 0,
    ) -> None:
        self.config = config
        self.legacy_array = legacy_array
        self.dp_rank = dp_rank
        self.recorder = EventRecorder(page_size, self._schedule)
        self.page_size = page_size
        self._offset = offset
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._scheduled = False
        self.port: int | None = None
        self.replay_port: int | None = None
        self.batches_sent = 0

    def bind(self, port: int | None = None, replay_port: int | None = None) -> None:
        """Open the sockets and bind (or connect) them; ``port`` and ``replay_port``, when
        given, replace the configured ports. A ``zmq.ZMQError`` leaves nothing open."""
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self._pub = pub
            endpoint = _endpoint(self.config.endpoint, self._offset, port)
            if self.config.binds:
                pub.bind(endpoint)
                self.port = _bound_port(pub)
            else:  # as SGLang: a concrete host without "bind": true is dialled, not bound
                pub.connect(endpoint)
                self.port = int(endpoint.rpartition(":")[2])
            if self.config.replay_endpoint:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                self._router = router
                router.bind(_endpoint(self.config.replay_endpoint, self._offset, replay_port))
                self.replay_port = _bound_port(router)
        except zmq.ZMQError:
            self.unbind()
            raise

    def unbind(self) -> None:
        """Close the sockets and the context (:meth:`close` once started)."""
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def start(self) -> None:
        """Bind the sockets (unless :meth:`bind` did) and publish the queued startup
        ``AllBlocksCleared``."""
        if self._pub is None:
            self.bind()
        if self._router is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        self.flush()

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.unbind()

    def _schedule(self) -> None:
        if self._scheduled or self._pub is None:
            return
        self._scheduled = True
        with contextlib.suppress(RuntimeError):  # no running loop: flushed at start()
            asyncio.get_running_loop().call_soon(self.flush)
            return
        self._scheduled = False

    def flush(self) -> None:
        """Publish the queued events as one batch (nothing if none are queued)."""
        self._scheduled = False
        events = self.recorder.take()
        if not events or self._pub is None:
            return
        payload = encode_batch(time.time(), events, self.dp_rank, self.legacy_array)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, _SEQ.pack(seq), payload], flags=zmq.NOBLOCK)
        self.batches_sent += 1

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # SGLang ignores malformed requests
            ident, start = frames[0], _SEQ.unpack(frames[2])[0]
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(self._reply(ident, _SEQ.pack(seq), payload))
            await router.send_multipart(self._reply(ident, _SEQ.pack(END_SEQ), b""))

    def _reply(self, ident: bytes, seq8: bytes, payload: bytes) -> list[bytes]:
        if self.legacy_array:
            return [ident, b"", seq8, payload]
        topic = self._topic if payload else b""
        return [ident, b"", topic, seq8, payload]

    def descriptor(self, dp_size: int = 1) -> dict[str, Any]:
        """The ``kv_events`` object of ``/server_info`` (§4.6): this publisher is rank 0
        of ``dp_size`` ranks, rank r publishing on ``endpoint_port_base + r``."""
        host = self.config.endpoint.removeprefix("tcp://").rpartition(":")[0]
        out: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": self.port,
            "topic": self.config.topic,
            "block_size": self.page_size,
            "dp_size": dp_size,
        }
        if self.replay_port is not None:
            out["replay_endpoint_port_base"] = self.replay_port
        return out
