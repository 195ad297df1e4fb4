"""Exact mode: follow the workers' KV-cache events (SGLANG_API.md §4), know when to stop.

Pieces, each small:

* :func:`decode_batch` reads an ``EventBatch`` in either encoding (0.5.23 tagged maps,
  ≤0.5.18 tagged arrays), ignoring unknown keys and trailing elements;
* :class:`ExactIndex` holds, per worker and DP rank, the blocks the worker reported.
  Blocks are keyed by the **gateway's own** chained hash of their token ids
  (:func:`chain_hashes`, XXH3-64 seeded by the previous block, the root seeded by the
  namespace: LoRA, ``cache_salt``, ``extra_key``); the engine's hashes serve only as ids,
  to link a ``BlockStored`` to its parent and to apply ``BlockRemoved``. A store whose
  parent is unknown (events lost before we subscribed) is dropped: the index may then
  under-predict, never over-predict. Blocks whose ``block_size`` differs from the
  worker's advertised one are dropped too (as Dynamo does);
* :class:`RankFeed` is one ZMQ SUB per (worker, DP rank) with sequence checking: a jump
  asks the replay endpoint for the missing batches; a sequence that goes backwards means
  the worker restarted (its entries are cleared); a gap replay cannot fill clears the
  rank and marks the worker degraded for ``stale_timeout_s``;
* :class:`KVEventsManager` discovers each worker's ``kv_events`` descriptor from
  ``/server_info``, runs the feeds, tracks each worker's **mode** and answers
  :meth:`KVEventsManager.match` for the workers in exact mode.

Modes, per worker: ``approximate`` (no events configured or discoverable), ``exact``
(events flowing), ``degraded`` (events configured but a request dispatched there saw no
event within ``stale_timeout_s``, or a gap could not be filled). An idle worker publishes
nothing, so silence alone is not staleness: only silence *after a dispatch* is. The
router uses the approximate prefix index for any worker not in exact mode, so a stopped
publisher degrades to the approximate behaviour, visibly, and the return is automatic.

Hybrid: blocks of a request dispatched to an exact-mode worker are kept as *predicted*
entries for a TTL, so siblings of a prompt still in prefill co-locate. The TTL is
``ttl_factor`` times the running mean of the observed delay between dispatch and the
``BlockStored`` that confirms the prediction, clamped to ``[ttl_min_s, ttl_max_s]``.

Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgpack
import orjson
import zmq
import zmq.asyncio
from xxhash import xxh3_64_intdigest

from gateway.config import KVEventsConfig
from gateway.exact.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MODE_EXACT = "exact"
MODE_APPROXIMATE = "approximate"
MODE_DEGRADED = "degraded"
MODES = (MODE_EXACT, MODE_APPROXIMATE, MODE_DEGRADED)
END_SEQ = 2**64 - 1
_SEQ = struct.Struct(">Q")
_MASK64 = 2**64 - 1


# ---------------------------------------------------------------------- wire
@dataclass(slots=True)
class Stored:
    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class Removed:
    block_hashes: list[int]


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
        )
    if kind == "BlockRemoved":
        return Removed(list(raw.get("block_hashes") or []))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _event_from_array(raw: Sequence[Any]) -> Event | None:
    kind = raw[0] if raw else None
    if kind in ("BlockStored", "BlockStoredWithMetadata") and len(raw) >= 5:
        meta = next((x for x in raw[7:] if isinstance(x, dict)), {})
        return Stored(list(raw[1]), raw[2], list(raw[3]), int(raw[4]), meta.get("cache_salt"), None)
    if kind == "BlockRemoved" and len(raw) >= 2:
        return Removed(list(raw[1]))
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


# ---------------------------------------------------------------------- hashing
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


# ---------------------------------------------------------------------- index
@dataclass(slots=True)
class _RankBlocks:
    by_engine: dict[int, int] = field(default_factory=dict)  # engine hash → our hash


class ExactIndex:
    """Blocks each worker reported, keyed by our own chained hashes (module docstring)."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], _RankBlocks] = {}
        self._held: dict[str, dict[int, int]] = {}  # worker → our hash → ranks holding it
        self.dropped_orphans = 0
        self.dropped_block_size = 0

    def apply(self, worker_id: str, rank: int, event: Event, block_size: int) -> list[int]:
        """Apply one event; return our hashes of the blocks it stored (for the hybrid)."""
        state = self._ranks.setdefault((worker_id, rank), _RankBlocks())
        held = self._held.setdefault(worker_id, {})
        if isinstance(event, Cleared):
            self.clear(worker_id, rank)
            return []
        if isinstance(event, Removed):
            for eh in event.block_hashes:
                ours = state.by_engine.pop(eh, None)
                if ours is not None:
                    self._release(held, ours)
            return []
        return self._store(state, held, event, block_size)

    def _store(
        self, state: _RankBlocks, held: dict[int, int], event: Stored, block_size: int
    ) -> list[int]:
        if event.block_size != block_size or block_size <= 0:
            self.dropped_block_size += 1
            return []
        if event.parent is None:
            seed = namespace_seed(event.lora_name, event.cache_salt, None)
        else:
            parent = state.by_engine.get(event.parent)
            if parent is None:
                self.dropped_orphans += 1
                return []
            seed = parent
        ours = chain_hashes(event.token_ids, block_size, seed)
        for eh, h in zip(event.block_hashes, ours, strict=False):
            if eh not in state.by_engine:
                state.by_engine[eh] = h
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
        """Drop a rank's blocks, or all of a worker's (``rank=None``)."""
        held = self._held.get(worker_id, {})
        for key in [k for k in self._ranks if k[0] == worker_id and rank in (None, k[1])]:
            for h in self._ranks.pop(key).by_engine.values():
                self._release(held, h)

    def holds(self, worker_id: str, h: int) -> bool:
        return h in self._held.get(worker_id, ())

    def blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

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
        self._by_worker.pop(worker_id, None)


# ---------------------------------------------------------------------- feeds
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
        return cls(
            host,
            int(raw["endpoint_port_base"]),
            str(raw.get("topic") or ""),
            int(raw.get("block_size") or 1),
            int(raw.get("dp_size") or 1),
            int(replay) if replay is not None else None,
        )


Apply = Callable[[int, float, list[Event]], None]


class RankFeed:
    """One (worker, DP rank) subscription with gap replay and restart detection."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        desc: Descriptor,
        rank: int,
        apply: Apply,
        on_reset: Callable[[int], None],
        on_gap_lost: Callable[[int], None],
        replay_timeout_s: float = 1.0,
    ) -> None:
        self._ctx, self._desc, self.rank = ctx, desc, rank
        self._apply, self._on_reset, self._on_gap_lost = apply, on_reset, on_gap_lost
        self._replay_timeout = replay_timeout_s
        self.last_seq: int | None = None
        self._replayed: set[int] = set()
        self.batches = 0
        self.replays = 0
        self.restarts = 0
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, desc.topic.encode())
        self._sock.connect(f"tcp://{desc.host}:{desc.port_base + rank}")

    async def run(self) -> None:
        """Catch up from the replay buffer, then follow the live stream until cancelled."""
        try:
            if self._desc.replay_port_base is not None:
                await self._catch_up(0, None)
            while True:
                _topic, seq8, payload = (await self._sock.recv_multipart())[:3]
                await self._on_message(_SEQ.unpack(seq8)[0], payload)
        finally:
            self.close()

    def close(self) -> None:
        """Close the SUB socket (idempotent; ``run`` does it when cancelled)."""
        if not self._sock.closed:
            self._sock.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if seq in self._replayed:
            return  # already applied from the replay buffer
        self._replayed.clear()
        if last is not None and seq <= last:
            self.restarts += 1
            self._on_reset(self.rank)
            self.last_seq = None
            if seq > 0 and self._desc.replay_port_base is not None:
                await self._catch_up(0, seq)
        elif last is not None and seq > last + 1 and not await self._catch_up(last + 1, seq):
            self._on_gap_lost(self.rank)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            ts, events, _ = decode_batch(payload)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            log.warning("kv events: undecodable batch %d: %s", seq, exc)
            return
        self.last_seq = seq
        self.batches += 1
        self._apply(self.rank, ts, events)

    async def _catch_up(self, start: int, before: int | None) -> bool:
        """Apply buffered batches ``start ≤ seq < before``; False if ``start`` is lost."""
        if self._desc.replay_port_base is None:
            return False
        self.replays += 1
        got = await self._replay(start)
        if got is None or (before is not None and (not got or got[0][0] != start)):
            return False
        if before is None and got and got[0][0] != start:
            log.info("kv events: replay buffer starts at %d; history before is lost", got[0][0])
        for seq, payload in got:
            if before is None or seq < before:
                self._deliver(seq, payload)
                self._replayed.add(seq)
        return True

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            assert self._desc.replay_port_base is not None
            dealer.connect(f"tcp://{self._desc.host}:{self._desc.replay_port_base + self.rank}")
            await dealer.send_multipart([b"", _SEQ.pack(start)])
            out: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    seq8, payload = frames[-2], frames[-1]  # 0.5.23 has a topic before seq
                    seq = _SEQ.unpack(seq8)[0]
                    if seq == END_SEQ:
                        return out
                    out.append((seq, payload))
        except TimeoutError:
            return None
        finally:
            dealer.close(linger=0)


# ---------------------------------------------------------------------- manager
# The ``kv_events:`` config section, as the manager takes it (defaults and their reasons
# in gateway/config.py).
KVEventsSettings = KVEventsConfig


@dataclass(slots=True)
class _WorkerState:
    desc: Descriptor | None = None
    startup: Any = None
    feeds: list[RankFeed] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    awaiting_since: float | None = None  # first dispatch not yet followed by an event
    degraded_until: float = 0.0  # after an unfillable gap
    last_event_at: float | None = None
    last_delay_s: float | None = None


class KVEventsManager:
    """Discovery, feeds, modes and exact matching for a set of workers (module docstring).

    ``workers()`` lists ``(worker id, url)`` pairs to follow; the manager re-reads it and
    ``/server_info`` every ``discovery_interval_s``.
    """

    def __init__(
        self,
        settings: KVEventsSettings,
        tokenizer: Tokenizer,
        workers: Callable[[], Iterable[tuple[str, str]]],
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.index = ExactIndex()
        self.predicted = PredictedBlocks(
            settings.ttl_factor, settings.ttl_min_s, settings.ttl_max_s
        )
        self._workers = workers
        self._session = session
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._states: dict[str, _WorkerState] = {}
        self._discovery: asyncio.Task[None] | None = None
        self.fidelity: dict[tuple[str, str], Fidelity] = {}

    # lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        await self.discover()
        self._discovery = asyncio.get_running_loop().create_task(self._discover_forever())

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        for wid in list(self._states):
            await self._unsubscribe(wid)
        self._ctx.destroy(linger=0)

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # discovery must never stop; the next round retries
                log.exception("kv events: discovery failed")

    async def discover(self) -> None:
        """Subscribe to new workers, drop removed ones, resubscribe restarted ones."""
        current = dict(self._workers())
        for wid in [w for w in self._states if w not in current]:
            await self._unsubscribe(wid)
            self.index.clear(wid)
            self.predicted.forget(wid)
            del self._states[wid]
        infos = await asyncio.gather(*(self._server_info(url) for url in current.values()))
        for (wid, url), info in zip(current.items(), infos, strict=True):
            state = self._states.setdefault(wid, _WorkerState())
            if info is None:
                continue
            desc = Descriptor.parse(info.get("kv_events") or {}, url)
            startup = info.get("startup_time")
            if desc == state.desc and startup == state.startup:
                continue
            await self._unsubscribe(wid)
            self.index.clear(wid)
            state.desc, state.startup, state.awaiting_since = desc, startup, None
            if desc is not None:
                self._subscribe(wid, state, desc)

    async def _server_info(self, url: str) -> dict[str, Any] | None:
        try:
            timeout = aiohttp.ClientTimeout(total=2.0)
            async with self._session.get(f"{url}/server_info", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                body = orjson.loads(await resp.read())
                return body if isinstance(body, dict) else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None

    def _subscribe(self, wid: str, state: _WorkerState, desc: Descriptor) -> None:
        loop = asyncio.get_running_loop()
        for rank in range(desc.dp_size):
            feed = RankFeed(
                self._ctx,
                desc,
                rank,
                functools.partial(self._apply, wid),
                functools.partial(self.index.clear, wid),
                functools.partial(self._gap_lost, wid),
                self.settings.replay_timeout_s,
            )
            state.feeds.append(feed)
            state.tasks.append(loop.create_task(feed.run()))

    async def _unsubscribe(self, wid: str) -> None:
        state = self._states.get(wid)
        if state is None:
            return
        for task in state.tasks:
            task.cancel()
        for task in state.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for feed in state.feeds:
            feed.close()  # a task cancelled before it ran never reached its finally
        state.tasks.clear()
        state.feeds.clear()

    # events ------------------------------------------------------------------
    def _apply(self, wid: str, rank: int, ts: float, events: list[Event]) -> None:
        state = self._states.get(wid)
        if state is None or state.desc is None:
            return
        now = self._clock()
        state.last_event_at = now
        state.awaiting_since = None
        state.last_delay_s = max(0.0, time.time() - ts)
        for event in events:
            stored = self.index.apply(wid, rank, event, state.desc.block_size)
            if stored:
                self.predicted.confirm(wid, stored, now)

    def _gap_lost(self, wid: str, rank: int) -> None:
        self.index.clear(wid, rank)
        state = self._states.get(wid)
        if state is not None:
            state.degraded_until = self._clock() + self.settings.stale_timeout_s
        log.warning("kv events: worker %s rank %d lost batches replay could not fill", wid, rank)

    # modes and matching ------------------------------------------------------
    def mode(self, worker_id: str) -> str:
        state = self._states.get(worker_id)
        if state is None or state.desc is None:
            return MODE_APPROXIMATE
        now = self._clock()
        if now < state.degraded_until:
            return MODE_DEGRADED
        since = state.awaiting_since
        if since is not None and now - since > self.settings.stale_timeout_s:
            return MODE_DEGRADED
        return MODE_EXACT

    def modes(self) -> dict[str, str]:
        return {wid: self.mode(wid) for wid in self._states}

    def block_size(self, worker_id: str) -> int | None:
        state = self._states.get(worker_id)
        return state.desc.block_size if state is not None and state.desc is not None else None

    def request_hashes(
        self, ids: Sequence[int], namespace: Namespace, block_size: int
    ) -> list[int]:
        return chain_hashes(ids, block_size, namespace_seed(*namespace))

    def match(
        self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Iterable[str]
    ) -> dict[str, int]:
        """Matched **tokens** for every given worker in exact mode (0 included)."""
        out: dict[str, int] = {}
        now = self._clock()
        hashes_by_size: dict[int, list[int]] = {}
        for wid in worker_ids:
            size = self.block_size(wid)
            if size is None or self.mode(wid) != MODE_EXACT:
                continue
            if ids is None or namespace[2]:  # extra_key is not in events: never claim a hit
                out[wid] = 0
                continue
            hashes = hashes_by_size.get(size)
            if hashes is None:
                hashes = hashes_by_size[size] = self.request_hashes(ids, namespace, size)
            n = 0
            for h in hashes:
                if not (
                    self.index.holds(wid, h)
                    or (self.settings.hybrid and self.predicted.holds(wid, h, now))
                ):
                    break
                n += 1
            out[wid] = n * size
        return out

    def dispatched(self, worker_id: str, ids: Sequence[int] | None, namespace: Namespace) -> None:
        """A request went to ``worker_id``: expect an event; predict its blocks (hybrid)."""
        state = self._states.get(worker_id)
        if state is None or state.desc is None:
            return
        now = self._clock()
        if state.awaiting_since is None:
            state.awaiting_since = now
        if self.settings.hybrid and ids is not None and not namespace[2]:
            hashes = self.request_hashes(ids, namespace, state.desc.block_size)
            self.predicted.record(worker_id, hashes, now)

    def prepare(self, kind: str, body: bytes) -> ExactRequest:
        """A request for matching and dispatch (``kind``: an ApiKind value), tokenized at
        most once and only if some worker needs its tokens."""
        return ExactRequest(self, kind, body)

    def wants_tokens(self, worker_ids: Iterable[str]) -> bool:
        """Whether any of these workers is followed (exact mode or predicting)."""
        return any(self.block_size(w) is not None for w in worker_ids)

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        """Fidelity: predicted vs reported cached tokens of one finished request."""
        f = self.fidelity.setdefault((worker_id, mode), Fidelity())
        f.requests += 1
        f.predicted_tokens += predicted
        f.true_predicted_tokens += min(predicted, reported)
        f.reported_tokens += reported

    def describe(self) -> dict[str, Any]:
        """For the debug API: mode, blocks, feeds and delays per worker."""
        out: dict[str, Any] = {}
        for wid, state in self._states.items():
            out[wid] = {
                "mode": self.mode(wid),
                "blocks": self.index.blocks(wid),
                "batches": sum(f.batches for f in state.feeds),
                "replays": sum(f.replays for f in state.feeds),
                "restarts": sum(f.restarts for f in state.feeds),
                "last_event_delay_s": state.last_delay_s,
            }
        return {
            "workers": out,
            "predicted_ttl_s": self.predicted.ttl_s,
            "dropped_orphans": self.index.dropped_orphans,
        }


Namespace = tuple[str | None, str | None, str | None]  # (LoRA, cache_salt, extra_key)


@dataclass(slots=True)
class Fidelity:
    """Predicted vs reported cached tokens, cumulative, for one (worker, mode)."""

    requests: int = 0
    predicted_tokens: int = 0
    true_predicted_tokens: int = 0  # Σ min(predicted, reported): precision numerator
    reported_tokens: int = 0


class ExactRequest:
    """One request as exact mode sees it; tokenized lazily, at most once."""

    __slots__ = ("_body", "_done", "_ids", "_kind", "_mgr", "_namespace")

    def __init__(self, mgr: KVEventsManager, kind: str, body: bytes) -> None:
        self._mgr, self._kind, self._body = mgr, kind, body
        self._ids: list[int] | None = None
        self._namespace: Namespace = (None, None, None)
        self._done = False

    def tokens(self) -> tuple[list[int] | None, Namespace]:
        if not self._done:
            self._ids, self._namespace = request_tokens(self._kind, self._body, self._mgr.tokenizer)
            self._done = True
        return self._ids, self._namespace

    def match(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Matched tokens of the workers in exact mode (others absent)."""
        if not self._mgr.wants_tokens(worker_ids):
            return {}
        return self._mgr.match(*self.tokens(), worker_ids)

    def dispatched(self, worker_id: str) -> None:
        if self._mgr.wants_tokens([worker_id]):
            self._mgr.dispatched(worker_id, *self.tokens())

    def mode(self, worker_id: str) -> str:
        return self._mgr.mode(worker_id)

    def observe(self, worker_id: str, mode: str, predicted: int, reported: int) -> None:
        self._mgr.observe(worker_id, mode, predicted, reported)


def request_tokens(
    kind: str, body: bytes, tokenizer: Tokenizer
) -> tuple[list[int] | None, Namespace]:
    """The token ids a worker caches for this body, and its namespace; None if unknown.

    ``kind`` is ``chat``, ``completions`` or ``generate`` (others: None). A batch is
    tokenized on its first prompt (routing keys on it).
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, (None, None, None)
    if not isinstance(obj, dict):
        return None, (None, None, None)
    namespace = _request_namespace(obj)
    try:
        return _tokens(kind, obj, tokenizer), namespace
    except (TypeError, ValueError, AttributeError):
        return None, namespace


def _request_namespace(obj: Mapping[str, Any]) -> Namespace:
    lora = obj.get("lora_path")
    model = obj.get("model")
    if not lora and isinstance(model, str) and ":" in model:
        lora = model.split(":", 1)[1]
    salt, extra = obj.get("cache_salt"), obj.get("extra_key")
    return (
        str(lora) if lora else None,
        str(salt) if salt else None,
        str(extra) if extra else None,
    )


def _tokens(kind: str, obj: Mapping[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    if kind == "chat":
        messages = obj.get("messages")
        return tokenizer.encode_chat(messages, obj.get("tools")) if messages else None
    value = obj.get("prompt") if kind == "completions" else obj.get("text")
    if kind == "generate" and value is None:
        value = obj.get("input_ids")
    if kind not in ("completions", "generate") or value is None:
        return None
    if isinstance(value, list) and value and not isinstance(value[0], int):
        value = value[0]  # a batch: its first prompt
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return None
