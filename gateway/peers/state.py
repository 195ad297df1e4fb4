"""Several gateways, one view: the prefix index, load and worker set shared on Redis.

Contract:
- Nothing here is on the request path. :meth:`SharedState.record` and the worker-change
  notifications are synchronous O(1) appends to bounded queues; everything that talks to
  Redis runs in :meth:`SharedState.run`, a background loop. When the queues are full the
  newest item is dropped and counted (``dropped``). When Redis is slow or down the gateway
  keeps routing on its local state: the loop flags ``degraded``, forgets its peers' load
  (stale counts would mislead more than none), retries with exponential back-off and, once
  Redis answers, resynchronises (worker set, then the prefix index) and clears the flag.
- **Prefix index.** Recordings are batched every ``tick_s`` (deduplicated by worker and
  last chained hash, which names the whole prefix) and appended to one Redis stream
  (``XADD ... MAXLEN ~ stream_maxlen``), each entry tagged with the gateway id and the
  wall time of its oldest recording. Every gateway reads the stream from its cursor and
  records its peers' entries (never its own) into its local index, for workers it knows.
  Replication lag (recording at one gateway → applied at another) is observed per entry;
  it assumes the gateways' wall clocks agree (NTP), as on one host.
- **Catch-up.** At start, and after a reconnect whose cursor fell behind the stream's
  trimmed part (``XINFO STREAM``'s ``max-deleted-entry-id``), the gateway loads the index
  snapshot (every ``snapshot_interval_s`` some gateway writes its whole local index with
  the stream position it reflects) and then reads the stream from that position.
- **Load.** Every tick a gateway writes its per-worker local figures (in-flight, queued
  prefill tokens, decoding) to a hash of its own with ``PEXPIRE load_ttl_s`` and reads its
  live peers' hashes; the fleet target receives the sum over peers. A gateway that stops
  publishing disappears from the sum when its hash expires.
- **Worker set.** A hash ``url → state`` (opaque to this module; the fleet target puts
  ``active``/``draining`` and the worker kind there) plus a version counter. Every tick
  the local set is compared with the set last written or applied; differences (admin
  adds, removals, drains on this gateway, also those made while Redis was down) are
  written and the version bumped. When the version changed, the shared hash is applied
  to the local registry. The first gateway to find no worker set (new deployment, or
  Redis restarted empty) seeds it from its own workers; afterwards the shared set wins,
  also over a restarted gateway's ``--worker-urls``.

Keys (all under the hash tag ``{prefix}``, so a Redis Cluster keeps them in one slot):
``{p}:index`` (stream), ``{p}:snapshot`` (hash: data, pos), ``{p}:load:<gateway>``
(hash), ``{p}:gateways`` (sorted set: gateway → last publish, wall ms),
``{p}:workers`` (hash), ``{p}:workers:version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from gateway.peers.codec import (
    CodecError,
    LoadFigures,
    pack_items,
    pack_load,
    stream_id,
    unpack_items,
    unpack_load,
)
from gateway.telemetry.metrics import HistogramChild

log = logging.getLogger(__name__)

ACTIVE = "active"
DRAINING = "draining"
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_ITEMS = 512  # recordings per stream entry: entries stay well under a megabyte
_GATEWAY_FORGET_MS = 60_000  # a gateway silent this long leaves the sorted set
_CONNECTION_ERRORS = (RedisError, OSError, asyncio.TimeoutError, CodecError)


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """How one gateway shares state. Defaults: see ``config/gateway.yaml`` (redis)."""

    url: str
    prefix: str = "prefix-gateway"
    password: str | None = None  # used when the URL carries none
    gateway_id: str | None = None  # None: a random id per process
    tick_s: float = 0.1  # publish and read period: bounds replication lag
    load_ttl_s: float = 1.0  # a silent gateway's load expires after this
    stream_maxlen: int = 100_000  # recordings batches kept on the stream (approximate)
    snapshot_interval_s: float = 30.0
    queue_size: int = 20_000  # pending recordings; more are dropped and counted
    timeout_s: float = 0.5  # per Redis round trip; slower counts as down
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    read_count: int = 500  # stream entries per read


class IndexTarget(Protocol):
    """What shared state needs of the local prefix index."""

    def record(self, block_hashes: Sequence[int], worker_id: str) -> None: ...
    def workers(self) -> list[str]: ...
    def blocks(self, worker_id: str) -> Sequence[int]:
        """The worker's believed blocks, most recently used first."""
        ...


class FleetTarget(Protocol):
    """What shared state needs of the local worker registry."""

    def local_load(self) -> dict[str, LoadFigures]:
        """Worker id → this gateway's own figures."""
        ...

    def set_peer_load(self, load: Mapping[str, LoadFigures]) -> None:
        """Worker id → the sum of live peers' figures (absent: zero)."""
        ...

    def worker_states(self) -> dict[str, str]:
        """Worker URL → ``active`` or ``draining``."""
        ...

    def apply_workers(self, states: Mapping[str, str], keep: frozenset[str]) -> None:
        """Make the local set equal ``states``, leaving URLs in ``keep`` alone."""
        ...

    def knows(self, worker_id: str) -> bool: ...


def _reraise_cancellation(exc: BaseException) -> None:
    """redis-py may turn a cancellation that lands mid-command into a connection error;
    a cancelled task must still stop, so raise CancelledError again."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


class _Keys:
    def __init__(self, prefix: str) -> None:
        p = "{" + prefix + "}"
        self.root = p
        self.stream = f"{p}:index"
        self.snapshot = f"{p}:snapshot"
        self.gateways = f"{p}:gateways"
        self.workers = f"{p}:workers"
        self.version = f"{p}:workers:version"

    def load(self, gateway_id: str) -> str:
        return f"{self.root}:load:{gateway_id}"


def connect(settings: SharedSettings) -> aioredis.Redis:
    """A client for ``settings.url`` (``redis://``, ``rediss://``, ``unix://``).

    No client-side retries: the supervisor loop retries with back-off, and a failed
    round trip must surface quickly as degraded mode."""
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.timeout_s,
        "socket_connect_timeout": settings.timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if settings.password:
        kwargs["password"] = settings.password
    client: aioredis.Redis = aioredis.Redis.from_url(settings.url, **kwargs)
    return client


class SharedState:
    """One gateway's link to the shared state; see the module contract."""

    def __init__(
        self,
        settings: SharedSettings,
        index: IndexTarget,
        fleet: FleetTarget,
        *,
        client_factory: Callable[[SharedSettings], aioredis.Redis] = connect,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.gateway_id = settings.gateway_id or uuid.uuid4().hex[:12]
        self._gid = self.gateway_id.encode()
        self._keys = _Keys(settings.prefix)
        self._index = index
        self._fleet = fleet
        self._client_factory = client_factory
        self._wall = wall
        self._rng = rng or random.Random()
        # (worker id, last block hash) → (hashes, wall time first queued)
        self._pending: dict[tuple[str, int], tuple[Sequence[int], float]] = {}
        # the worker set as last written or applied; None before the first sync
        self._known: dict[str, str] | None = None
        self._cursor: bytes | None = None
        self._version: bytes | None = None
        self._peers: list[bytes] = []
        self._published: set[str] = set()
        self._next_snapshot = time.monotonic() + settings.snapshot_interval_s * (
            0.5 + self._rng.random()
        )
        self.degraded = True  # until the first synchronisation succeeds
        self.dropped: dict[str, int] = {"records": 0}
        self.published_records = 0
        self.applied_records = 0
        self.reconnects = 0
        self.lag = HistogramChild(LAG_BUCKETS)
        self.lag_bounds = LAG_BUCKETS
        self.lag_samples: deque[float] = deque(maxlen=4096)  # recent, for benchmarks
        self.synced = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def peer_count(self) -> int:
        """Other gateways seen in the last round trip."""
        return len(self._peers)

    # --- the gateway side: synchronous, O(1) ---------------------------------------

    def record(self, block_hashes: Sequence[int], worker_id: str) -> None:
        """Queue a recording for the peers (the caller already recorded it locally)."""
        if not block_hashes:
            return
        key = (worker_id, block_hashes[-1])
        pending = self._pending
        if key in pending:
            return
        if len(pending) >= self.settings.queue_size:
            self.dropped["records"] += 1
            return
        pending[key] = (block_hashes, self._wall())

    # --- the background side -------------------------------------------------------

    async def run(self) -> None:
        """Synchronise, then publish and read every tick; on failure back off and
        resynchronise. Returns after :meth:`stop` (between round trips, so no command is
        cut in half) and closes its client."""
        client = self._client_factory(self.settings)
        backoff = self.settings.backoff_min_s
        try:
            while not self._stop_requested():
                try:
                    await self._sync(client)
                    self._set_degraded(False)
                    backoff = self.settings.backoff_min_s
                    while not await self._sleep(self.settings.tick_s):
                        await self._tick(client)
                        if self._stop_requested():
                            return
                except _CONNECTION_ERRORS as exc:
                    _reraise_cancellation(exc)
                    self._set_degraded(True)
                    log.warning("shared state: Redis unavailable (%s); retrying", exc)
                    await self._sleep(backoff * (0.5 + self._rng.random()))
                    backoff = min(backoff * 2, self.settings.backoff_max_s)
                    self.reconnects += 1
        finally:
            with contextlib.suppress(*_CONNECTION_ERRORS):
                await client.aclose()

    def _stop_requested(self) -> bool:
        """Asked to stop, or cancelled (also when redis-py swallowed the cancellation)."""
        task = asyncio.current_task()
        return self._stopping.is_set() or (task is not None and task.cancelling() > 0)

    def stop(self) -> None:
        """Ask :meth:`run` to return after its current round trip."""
        self._stopping.set()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when asked to stop."""
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        return self._stop_requested()

    def _set_degraded(self, degraded: bool) -> None:
        if degraded and not self.degraded:
            self._fleet.set_peer_load({})
        if not degraded:
            self.synced.set()
        self.degraded = degraded

    async def _sync(self, client: aioredis.Redis) -> None:
        """Worker set first (so ``knows`` is right), then the index catch-up."""
        if self._known is not None:  # a reconnect: changes made meanwhile go out first
            await self._publish_workers(client)
        if await client.get(self._keys.version) is None:
            await self._seed_workers(client)
        self._version = None
        await self._read_workers(client)
        if self._cursor is None or await self._trimmed_past(client, self._cursor):
            await self._load_snapshot(client)
        while await self._read_stream(client) >= self.settings.read_count:
            pass

    async def _seed_workers(self, client: aioredis.Redis) -> None:
        states = self._fleet.worker_states()
        pipe = client.pipeline(transaction=True)
        if states:
            pipe.hset(self._keys.workers, mapping=states)  # type: ignore[arg-type]
        pipe.incr(self._keys.version)
        await pipe.execute()
        log.info("shared state: seeded the worker set with %d workers", len(states))

    def _local_changes(self) -> tuple[dict[str, str], dict[str, str]]:
        """(local worker states, those that differ from the last written or applied)."""
        local, known = self._fleet.worker_states(), self._known or {}
        changed = {u: s for u, s in local.items() if known.get(u) != s}
        changed.update({u: "" for u in known.keys() - local.keys()})  # "" = removed
        return local, changed

    async def _publish_workers(self, client: aioredis.Redis) -> None:
        """Write local changes of the worker set (admin adds, removals, drains)."""
        if self._known is None:
            return
        _, changed = self._local_changes()
        if not changed:
            return
        pipe = client.pipeline(transaction=True)
        for url, state in changed.items():
            if state:
                pipe.hset(self._keys.workers, url, state)
            else:
                pipe.hdel(self._keys.workers, url)
        pipe.incr(self._keys.version)
        await pipe.execute()
        for url, state in changed.items():
            if state:
                self._known[url] = state
            else:
                self._known.pop(url, None)

    async def _read_workers(self, client: aioredis.Redis) -> None:
        """On a new version, make the local set the shared one, except for local changes
        made while the round trips ran (written at the next tick)."""
        version: Any = await client.get(self._keys.version)
        if version is not None and version == self._version:
            return
        raw: dict[Any, Any] = await client.hgetall(self._keys.workers)
        states = {k.decode(): v.decode() for k, v in raw.items()}
        known = self._known
        pending = self._local_changes()[1] if known is not None else {}
        self._fleet.apply_workers(states, frozenset(pending))
        for url in pending:  # still differ from what was applied: written next tick
            if known is not None and url in known:
                states[url] = known[url]
            else:
                states.pop(url, None)
        self._known = states
        self._version = version

    async def _trimmed_past(self, client: aioredis.Redis, cursor: bytes) -> bool:
        try:
            info = await client.xinfo_stream(self._keys.stream)
        except ResponseError:  # no stream (yet, or Redis restarted empty)
            return False
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None:
            return stream_id(deleted) > stream_id(cursor)
        first = info.get("first-entry")  # Redis < 7: the oldest kept entry
        return first is not None and stream_id(first[0]) > stream_id(cursor)

    async def _load_snapshot(self, client: aioredis.Redis) -> None:
        raw: dict[Any, Any] = await client.hgetall(self._keys.snapshot)
        if not raw:
            self._cursor = self._cursor or b"0-0"
            return
        applied = 0
        for worker_id, hashes in unpack_items(raw.get(b"data", b"")):
            if self._fleet.knows(worker_id):
                self._index.record(hashes, worker_id)
                applied += len(hashes)
        self._cursor = raw.get(b"pos", b"0-0")
        log.info("shared state: loaded a snapshot of %d blocks at %s", applied, self._cursor)

    async def _read_stream(self, client: aioredis.Redis) -> int:
        """Apply the next entries after the cursor; return how many were read."""
        assert self._cursor is not None
        reply = await client.xread({self._keys.stream: self._cursor}, self.settings.read_count)
        return self._apply_entries(reply)

    def _apply_entries(self, reply: Any) -> int:
        if not reply:
            return 0
        entries: list[tuple[bytes, dict[bytes, bytes]]] = reply[0][1]
        now = self._wall()
        for entry_id, fields in entries:
            self._cursor = entry_id
            if fields.get(b"g") == self._gid:
                continue
            for worker_id, hashes in unpack_items(fields.get(b"b", b"")):
                if self._fleet.knows(worker_id):
                    self._index.record(hashes, worker_id)
                    self.applied_records += 1
            lag = max(0.0, now - float(fields.get(b"t", now)))
            self.lag.observe(lag)
            self.lag_samples.append(lag)
        return len(entries)

    async def _tick(self, client: aioredis.Redis) -> None:
        """One pipelined round trip: publish recordings and load; read the peers' load,
        the worker-set version and the stream. More only on a worker-set change, when the
        stream is far ahead, and for the periodic snapshot."""
        assert self._cursor is not None
        await self._publish_workers(client)
        batch = self._take_batch()
        pipe = client.pipeline(transaction=False)
        self._queue_batch(pipe, batch)
        local, peers = self._queue_load(pipe)
        pipe.get(self._keys.version)
        pipe.xread({self._keys.stream: self._cursor}, self.settings.read_count)
        try:
            replies: list[Any] = await pipe.execute()
        except _CONNECTION_ERRORS:
            self._requeue(batch)
            raise
        self.published_records += len(batch)
        self._published = set(local)
        version, entries = replies[-2], replies[-1]
        self._peers = [g for g in replies[-3 - len(peers)] if g != self._gid]
        self._sum_peer_load(replies[-2 - len(peers) : -2] if peers else [])
        if version != self._version:
            await self._read_workers(client)
        if self._apply_entries(entries) >= self.settings.read_count:
            while await self._read_stream(client) >= self.settings.read_count:
                pass
        if time.monotonic() >= self._next_snapshot:
            await self._write_snapshot(client)

    def _take_batch(self) -> list[tuple[str, Sequence[int], float]]:
        batch = [(w, hashes, t) for (w, _), (hashes, t) in self._pending.items()]
        self._pending = {}
        return batch

    def _requeue(self, batch: list[tuple[str, Sequence[int], float]]) -> None:
        """Put a batch that failed back in front of newer recordings, within the bound."""
        merged: dict[tuple[str, int], tuple[Sequence[int], float]] = {}
        for w, hashes, t in batch:
            merged[(w, hashes[-1])] = (hashes, t)
        for key, value in self._pending.items():
            merged.setdefault(key, value)
        limit = self.settings.queue_size
        if len(merged) > limit:
            self.dropped["records"] += len(merged) - limit
            merged = dict(list(merged.items())[:limit])
        self._pending = merged

    def _queue_batch(self, pipe: Any, batch: list[tuple[str, Sequence[int], float]]) -> None:
        """XADD the recordings, up to ``_BATCH_ITEMS`` per stream entry."""
        for start in range(0, len(batch), _BATCH_ITEMS):
            chunk = batch[start : start + _BATCH_ITEMS]
            fields = {
                "g": self._gid,
                "t": repr(min(t for _, _, t in chunk)),
                "b": pack_items((w, h) for w, h, _ in chunk),
            }
            pipe.xadd(
                self._keys.stream, fields, maxlen=self.settings.stream_maxlen, approximate=True
            )

    def _queue_load(self, pipe: Any) -> tuple[dict[str, LoadFigures], list[bytes]]:
        """Publish this gateway's load; list the gateways; read the peers' load (those
        listed at the previous tick). Returns (published figures, peers read)."""
        keys, now_ms = self._keys, int(self._wall() * 1000)
        own = keys.load(self.gateway_id)
        local = self._fleet.local_load()
        stale = self._published - local.keys()
        if stale:
            pipe.hdel(own, *stale)
        if local:
            pipe.hset(own, mapping={w: pack_load(f) for w, f in local.items()})
        pipe.pexpire(own, int(self.settings.load_ttl_s * 1000))
        pipe.zadd(keys.gateways, {self.gateway_id: now_ms})
        pipe.zremrangebyscore(keys.gateways, 0, now_ms - _GATEWAY_FORGET_MS)
        pipe.zrange(keys.gateways, 0, -1)
        peers = list(self._peers)
        for peer in peers:
            pipe.hgetall(keys.load(peer.decode()))
        return local, peers

    def _sum_peer_load(self, replies: list[Any]) -> None:
        total: dict[str, list[int]] = {}
        for reply in replies:
            for field, value in reply.items():
                figures = unpack_load(value)
                if figures is None:
                    continue
                acc = total.setdefault(field.decode(), [0, 0, 0])
                for i in range(3):
                    acc[i] += figures[i]
        self._fleet.set_peer_load({w: (a[0], a[1], a[2]) for w, a in total.items()})

    async def _write_snapshot(self, client: aioredis.Redis) -> None:
        """Write the whole local index with the stream position it reflects."""
        interval = self.settings.snapshot_interval_s
        self._next_snapshot = time.monotonic() + interval * (0.75 + 0.5 * self._rng.random())
        data = pack_items((w, self._index.blocks(w)) for w in self._index.workers())
        pos = self._cursor or b"0-0"
        await client.hset(self._keys.snapshot, mapping={"data": data, "pos": pos})
