"""Drains that keep conversations warm and workers that join warm: the live gateway's I/O
around ``gateway.routing.rehome`` (which holds every rule, shared with the replay).

Contract:
- :meth:`Membership.drain` (``POST /workers/{id}/drain``): the worker is already flagged
  draining (no new requests); when re-homing is on, its chains used lately are given new
  homes among the routable workers serving its model and role, recorded in the prefix
  index at once (:func:`~gateway.routing.rehome.plan_rehome`), and, with a prompt store,
  the hottest are queued for pre-warming until the drain's deadline. The report is the
  answer's ``drain`` member and ``GET /workers/{id}/drain``'s body.
- :meth:`Membership.left` (the registry's removal listener): the worker left;
  whatever it still had queued is dropped, its report marked ``left``. Removal with
  ``?rehome=true`` re-homes first (:meth:`Membership.rehome_now`; no pre-warm: the
  worker is gone at once).
- :meth:`Membership.joined` (``POST /workers`` of a new worker, once probed): the worker
  ramps under slow start (``gateway.workers.slow_start``) and, with a prompt store, gets
  the fleet's most shared prefixes pre-warmed (sent only while it is healthy)
  (:func:`~gateway.routing.rehome.join_items`) within the same budget.
- :meth:`Membership.run` (a loop of the runtime) sends what the queue lets through: each
  pre-warm a prefill-only copy of the stored prompt (:func:`~gateway.routing.rehome
  .prefill_only`, the DP rank set for a rank), POSTed on the app's session to the path it
  came in on, counted on the home by a :class:`~gateway.routing.lease.Lease` (the
  policies see the work) and pinned in the index while in flight. No redirect is
  followed; at most 1 MiB of the answer is read; failures are counted, never retried.
- Reports are kept for the last :data:`MAX_REPORTS` drains and joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from gateway.forward import relay
from gateway.routing.lease import Lease
from gateway.routing.rehome import (
    PREWARM_PATHS,
    REASON_DRAIN,
    REASON_JOIN,
    ChainLog,
    IndexView,
    PrewarmItem,
    PrewarmJob,
    PrewarmQueue,
    RehomeReport,
    RehomeSettings,
    join_items,
    json_object,
    plan_rehome,
    prefill_only,
    still_wanted,
)
from gateway.routing.request import ApiKind, RequestError, RequestSettings, parse_request
from gateway.tasks import TaskSet
from gateway.workers.kinds import dp_rank_key
from gateway.workers.registry import Worker, WorkerRegistry
from gateway.workers.slow_start import SlowStart

log = logging.getLogger(__name__)

MAX_REPORTS = 64
_MAX_ANSWER = 1 << 20
_MAX_PREFIX_MESSAGES = 64

Stored = tuple[ApiKind, bytes]  # what the prompt store holds live: the kind and body


class IndexWithRelease(IndexView, Protocol):
    def release(
        self, worker_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None: ...


class MembershipHooks:
    """Telemetry's view of drains and pre-warms; no-ops here."""

    def drained(self, report: RehomeReport) -> None:
        """A drain planned its re-homing (``report`` as planned)."""

    def prewarmed(self, reason: str, outcome: str, tokens: int) -> None:
        """A pre-warm ended: ``outcome`` completed, failed, skipped or dropped."""


@dataclass(frozen=True, slots=True)
class MembershipSettings:
    rehome: RehomeSettings
    drain_deadline_s: float = 120.0
    join_prefixes: int = 4
    join_deadline_s: float = 120.0
    timeout_s: float = 60.0


class Membership:
    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        index: IndexWithRelease,
        chains: ChainLog[Stored] | None,
        queue: PrewarmQueue | None,
        settings: MembershipSettings,
        request_settings: RequestSettings,
        session: aiohttp.ClientSession,
        slow_start: SlowStart | None = None,
        hooks: MembershipHooks | None = None,
    ) -> None:
        self._registry = registry
        self._clock = registry.clock
        self._index = index
        self.chains = chains
        self._queue = queue
        self.settings = settings
        self._request_settings = request_settings
        self._session = session
        self.slow_start = slow_start
        self._hooks = hooks or MembershipHooks()
        self._drains: OrderedDict[str, RehomeReport] = OrderedDict()
        self._joins: OrderedDict[str, PrewarmJob] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._sends = TaskSet()
        self._dropped_seen: dict[int, int] = {}  # id(job) -> dropped already counted

    @property
    def prewarms(self) -> bool:
        """Pre-warming is possible (a prompt store and a budget)."""
        return self._queue is not None and self.chains is not None and self.chains.store is not None

    # -- drains -------------------------------------------------------------------------

    def drain(
        self,
        worker: Worker,
        *,
        rehome: bool,
        prewarm: bool,
        deadline_s: float | None = None,
    ) -> RehomeReport:
        """Re-home ``worker``'s chains (module contract); returns the drain's report."""
        now = self._clock()
        running = self._drains.get(worker.id)
        if running is not None and running.ended_s is None and running.job is not None:
            return running  # a second drain of a draining worker changes nothing
        job = None
        if rehome and prewarm and self.prewarms:
            deadline = self.settings.drain_deadline_s if deadline_s is None else deadline_s
            job = PrewarmJob(REASON_DRAIN, worker.id, now + deadline)
        report = self._rehome(worker, now, job, rehome)
        self._keep(self._drains, worker.id, report)
        self._hooks.drained(report)
        return report

    def _rehome(
        self, worker: Worker, now: float, job: PrewarmJob | None, rehome: bool
    ) -> RehomeReport:
        if not rehome or self.chains is None:
            return RehomeReport(worker.id, now)
        gone = {t.id for t in worker.targets()}
        homes = [
            t
            for t in self._registry.candidates((), worker.metadata.model, role=worker.role)
            if t.id not in gone
        ]
        loads = {t.id: float(t.queued_prefill_tokens + t.peer_queued_prefill_tokens) for t in homes}
        report, items = plan_rehome(
            self.chains, self._index, sorted(gone), loads, now, self.settings.rehome, job
        )
        report.worker = worker.id
        if self._queue is not None and items:
            self._queue.add(items)
            self._wake.set()
        return report

    def report(self, worker_id: str) -> dict[str, Any] | None:
        """The last drain of ``worker_id``, as ``GET /workers/{id}/drain`` shows it."""
        report = self._drains.get(worker_id)
        return None if report is None else report.as_dict(self._clock())

    def rehome_now(self, worker: Worker) -> RehomeReport:
        """Re-home ``worker``'s chains as it is removed (``DELETE ?rehome=true``): no
        pre-warm, it leaves at once."""
        self.left(worker)
        now = self._clock()
        report = self._rehome(worker, now, None, True)
        report.ended_s = now
        self._keep(self._drains, worker.id, report)
        self._hooks.drained(report)
        return report

    def left(self, worker: Worker) -> None:
        """``worker`` left the registry (module contract)."""
        now = self._clock()
        report = self._drains.get(worker.id)
        if report is not None and report.ended_s is None:
            report.ended_s = now
            if report.job is not None and self._queue is not None:
                self._queue.stop(report.job)
                self._count_dropped(report.job)
        join = self._joins.get(worker.id)
        if join is not None and self._queue is not None:
            self._queue.stop(join)
            self._count_dropped(join)
        if self.slow_start is not None:
            self.slow_start.forget(worker.id)

    # -- joins --------------------------------------------------------------------------

    def joined(self, worker: Worker, *, prewarm: bool) -> None:
        """``worker`` was added at run time and probed once (module contract)."""
        if self.slow_start is not None:
            self.slow_start.begin(worker.id)
        if not (prewarm and self.prewarms and self.settings.join_prefixes > 0):
            return
        assert self._queue is not None and self.chains is not None
        now = self._clock()
        job = PrewarmJob(REASON_JOIN, worker.id, now + self.settings.join_deadline_s)
        self._keep(self._joins, worker.id, job)
        candidates = self._registry.candidates((), worker.metadata.model, role=worker.role)
        fleet = [t.id for t in candidates if t.server is not worker]
        for target in worker.targets():
            items = join_items(
                self.chains, self._index, target.id, [target.id, *fleet], now,
                self.settings.rehome.prewarm_recent_s, self.settings.join_prefixes, job,
            )  # fmt: skip
            self._queue.add(items)
        self._wake.set()

    def join_report(self, worker_id: str) -> dict[str, Any] | None:
        """A joining worker's ramp and pre-warm (``GET /workers/{id}/join``); None for a
        worker doing neither."""
        now, job, ramp = self._clock(), self._joins.get(worker_id), self.slow_start
        ramping = {} if ramp is None else ramp.ramping(now)
        if job is None and worker_id not in ramping:
            return None
        worker = self._registry.get(worker_id)
        slow = None
        if ramp is not None and worker is not None:
            factor = ramp.factor(worker.targets()[0].id, now)
            slow = {"remaining_s": ramping.get(worker_id, 0.0), "factor": round(factor, 4)}
        return {
            "worker": worker_id,
            "slow_start": slow,
            "prewarm": None if job is None else job.as_dict(),
        }

    # -- sending ------------------------------------------------------------------------

    async def run(self) -> None:
        """Send queued pre-warms as the budget allows, until cancelled."""
        queue = self._queue
        if queue is None:
            return
        try:
            while True:
                now = self._clock()
                for item in queue.due(now, self._in_flight, self._wanted):
                    self._in_flight[item.worker_id] = self._in_flight.get(item.worker_id, 0) + 1
                    self._sends.spawn(self._send(item), "prewarm")
                for job in [
                    *(r.job for r in self._drains.values() if r.job),
                    *self._joins.values(),
                ]:
                    self._count_dropped(job)
                wake = queue.next_wake(now, self._in_flight)
                self._wake.clear()
                timeout = None if wake is None else max(0.001, wake - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            await self._sends.close()

    def _wanted(self, item: PrewarmItem) -> bool:
        wanted = self.chains is not None and still_wanted(self.chains, item)
        if not wanted:
            self._hooks.prewarmed(item.job.reason, "skipped", 0)
        return wanted

    def _count_dropped(self, job: PrewarmJob) -> None:
        seen = self._dropped_seen.get(id(job), 0)
        if job.dropped > seen:
            self._dropped_seen[id(job)] = job.dropped
            for _ in range(job.dropped - seen):
                self._hooks.prewarmed(job.reason, "dropped", 0)

    async def _send(self, item: PrewarmItem) -> None:
        job = item.job
        ok, reported = False, 0
        try:
            ok, reported = await self._post(item)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.info("pre-warm of %s failed: %s", item.worker_id, type(exc).__name__)
        finally:
            self._in_flight[item.worker_id] -= 1
            if not self._in_flight[item.worker_id]:
                del self._in_flight[item.worker_id]
            self._wake.set()
        if ok:
            job.completed += 1
            job.tokens_reported += reported
        else:
            job.failed += 1
        self._hooks.prewarmed(job.reason, "completed" if ok else "failed", item.tokens)

    async def _post(self, item: PrewarmItem) -> tuple[bool, int]:
        worker = self._registry.get(item.worker_id)
        stored = None if self.chains is None else self.chains.payload(*item.key)
        if worker is None or not worker.healthy or stored is None:
            return False, 0
        kind, body = stored
        if item.prefix_blocks is not None:
            cut = prefix_body(kind, body, item.chain, self._request_settings)
            if cut is None:
                return False, 0
            body = cut
        members = {}
        if worker.dp_rank is not None:
            members[dp_rank_key(worker.metadata.version)] = worker.dp_rank
        data = prefill_only(kind, body, members)
        if data is None:
            return False, 0
        lease = Lease(worker, item.tokens)
        self._index.record(item.chain, worker.id, self._clock())  # pinned while in flight
        try:
            async with self._session.post(
                worker.url + PREWARM_PATHS[kind],
                data=data,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
                allow_redirects=False,
            ) as resp:
                raw = await resp.content.read(_MAX_ANSWER)
                ok = resp.status == 200
        finally:
            lease.release()
            self._index.release(worker.id, item.chain, self._clock())
        prompt = relay.prompt_tokens(raw)
        cached = relay.cached_tokens(raw) or 0
        return ok, max(0, prompt - cached) if ok and prompt is not None else 0

    async def close(self) -> None:
        await self._sends.close()

    @staticmethod
    def _keep(table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table.pop(key, None)
        table[key] = value
        while len(table) > MAX_REPORTS:
            table.popitem(last=False)


def prefix_body(
    kind: ApiKind, body: bytes, chain: Sequence[int], settings: RequestSettings
) -> bytes | None:
    """``body`` cut to a prompt within ``chain``'s blocks (a join's shared prefix): a
    chat's first messages (as many as stay within it, checked by hashing them as the
    gateway does), a text prompt cut at its characters, token ids at its tokens. None
    when nothing fits."""
    obj = json_object(body)
    if obj is None:
        return None
    limit = len(chain) * settings.block_chars
    if kind is ApiKind.CHAT:
        return _chat_prefix(obj, chain, settings)
    key = "prompt" if kind is ApiKind.COMPLETIONS else "text"
    value = obj.get(key)
    if isinstance(value, str):
        obj[key] = value.encode()[:limit].decode(errors="ignore")
    elif kind is ApiKind.GENERATE and isinstance(obj.get("input_ids"), list):
        obj["input_ids"] = obj["input_ids"][: limit // 4]
    else:
        return None
    return orjson.dumps(obj)


def _chat_prefix(
    obj: dict[str, Any], chain: Sequence[int], settings: RequestSettings
) -> bytes | None:
    messages = obj.get("messages")
    if not isinstance(messages, list):
        return None
    best = None
    for k in range(1, min(len(messages), _MAX_PREFIX_MESSAGES) + 1):
        body = orjson.dumps({**obj, "messages": messages[:k]})
        try:
            req = parse_request(ApiKind.CHAT, body, {}, settings)
        except RequestError:
            return best
        full = req.prompt_chars // req.block_chars
        if full > len(chain) or list(req.block_hashes[:full]) != list(chain[:full]):
            break
        best = body
    return best
