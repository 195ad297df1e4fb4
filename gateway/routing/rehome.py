"""Drains that keep conversations warm, new workers that start warm: the part without I/O.

Written once for both drivers: the live gateway (``gateway.routing.prewarm`` sends the
requests) and the offline replay (``loadtests.replay.membership`` submits them to the
simulated workers on its virtual clock). Nothing here reads a clock: every call that
needs the time takes ``now``.

**Chains** (:class:`ChainLog`): the prefix index holds blocks, not which prompts they
belong to. To re-home a worker's prefixes the gateway needs the *chains* (the ordered
block lists of the prompts dispatched there) and when each was last used. The cheapest
honest structure: per routing target, a ring of the chains recorded at dispatch (the
request's own block list, referenced, not copied; the block hashes are the index's own
integers), keyed by the chain's last block, most recently used last. A conversation's
next turn *extends* its previous chain: the previous turn's last block is found among
the new chain's last ``extend_scan`` blocks and its entry is replaced, so a conversation
costs one entry whatever its turns (``uses`` counts them). Bounded per target by
``max_chains`` entries and by ``blocks_factor`` x the target's capacity in blocks
(``PrefixIndex.capacity_blocks``): older chains than that no longer fit the worker's
cache anyway. Cost at dispatch: one set test of the chain's last ``extend_scan`` blocks
against the target's ring (about 9 us of CPU for a 750-block prompt on the shared 2-core
machine), 8 bytes per block referenced.

**Prompts** (:class:`PromptStore`): pre-warming needs the prompt itself, and the gateway
otherwise keeps none (docs/SECURITY.md). Opt-in and bounded in bytes: the most recent
request body of each chain in the log, least recently stored dropped first; off (no
store) by default. Only re-sent to a worker of the same fleet, as a prefill-only request
(:func:`prefill_only`); never logged or shown.

**Re-homing** (:func:`plan_rehome`): only what was *reused* is worth a new home: of each
chain of the drained target used within ``recent_s``, its *hot* part is all of it once
its conversation came back (``uses`` at least ``min_uses``: a later turn extended it),
else the prefix it reused when it was sent (``reused``: the blocks the target was
believed to hold already, a sibling's prefix); and all of every chain when at least
``returning_share`` of the target's recent chains came back (a chat fleet, whose
conversations on their first turn will come back too; on the Mooncake conversation trace
about 1 % do, and pre-warming them all cost more than it saved). A hot part the target
holds beyond what any other candidate holds (by at least ``min_blocks``) gets a new
home: the candidate with the least ``load + tokens it would have to compute``, where
load is its queued prefill tokens, plus the tokens of the chains it was sent within
``recent_s`` (the conversations it holds: the work they will bring), plus the hot parts
this drain already gave it; so conversations are spread by load and a chain sharing a
long prefix with one re-homed before follows it there when that is cheaper. Optionally
no home is given more than ``max_home_share`` x an even share (over the candidates) of
the tokens the drain's parts need computed (by load alone, 3 of 7 homes took all 117
conversations of a multi-turn drain; spread at 1.25, the fleet's routing then collapsed
onto 4 workers: off by default, BENCHMARKS.md, "Drains and scale-out"). The part is
recorded under its new home in the prefix index (unpinned, as a peer's recording), so
the conversation's next turn goes there, and the chain's entry and prompt move to the
new home's log. Chains never reused are left alone: recording them would push real
entries out of the homes' index for prompts no engine holds, and pre-warming them would
spend the budget on prompts that do not come back (measured: BENCHMARKS.md, "Drains and
scale-out"). The chains of every drained target are planned hottest (most recently used)
first.

**Pre-warming** (:class:`PrewarmQueue`): the re-homed parts used within
``prewarm_recent_s`` whose prompt is stored are queued, hottest first, as prefill-only
requests to their new homes (a reused prefix: the prompt cut to it), paced by one
fleet-wide :class:`TokenBudget` (tokens per second, a burst) and at most
``max_in_flight`` per home, optionally only to a home whose queued prefill tokens (live
requests and pre-warms) are at most ``max_home_queued_tokens`` (so pre-warms do not
queue ahead of live requests; a busy home is polled); whatever is still queued when the
drained worker leaves (its job's deadline) is dropped. A queued chain whose
conversation came back meanwhile (its entry no longer in the new home's log: the next
turn extended it there) is skipped: that turn computed it. Budget units are the tokens
the home is believed not to hold when the chain is planned.

**Joining workers** (:func:`shared_prefixes`): the fleet's most shared prefixes (the
longest prefix of recent chains that at least half the workers are believed to hold:
system prompts, tool lists), each with a stored prompt that contains it, to pre-warm on
a new worker within the same budget.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import orjson

from gateway.routing.request import ApiKind, RouteRequest

T = TypeVar("T")

# the paths a stored prompt is re-sent to, per kind (the routes it came in on)
PREWARM_PATHS: Mapping[ApiKind, str] = {
    ApiKind.CHAT: "/v1/chat/completions",
    ApiKind.COMPLETIONS: "/v1/completions",
    ApiKind.GENERATE: "/generate",
}
# members dropped from a prefill-only copy: they would stream, sample several answers,
# return log-probabilities, or name a request id of the client's
_DROPPED = (
    "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo", "rid",
    "return_logprob", "max_completion_tokens",
)  # fmt: skip

REASON_DRAIN = "drain"
REASON_JOIN = "join"


class IndexView(Protocol):
    """What re-homing needs of the prefix index (``gateway.routing.prefix_index``)."""

    def match(self, block_hashes: Sequence[int]) -> Mapping[str, int]: ...
    def record(
        self, block_hashes: Sequence[int], worker_id: str, now: float | None = None, *,
        pin: bool = True,
    ) -> None: ...  # fmt: skip
    def block_tokens(self, worker_id: str) -> float: ...
    def capacity_blocks(self, worker_id: str) -> int: ...


# --- prompts ---------------------------------------------------------------------------


class PromptStore(Generic[T]):
    """The most recent prompt of each logged chain, bounded in bytes (module docstring).
    Keyed by (target id, the chain's last block); least recently stored dropped first;
    a prompt over ``max_item_bytes`` is not kept."""

    def __init__(self, max_bytes: int, size: Callable[[T], int], max_item_bytes: int = 0) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.max_item_bytes = max_item_bytes or max(1, max_bytes // 8)
        self._size = size
        self._items: OrderedDict[tuple[str, int], tuple[T, int]] = OrderedDict()
        self.bytes = 0
        self.dropped = 0  # prompts dropped for room

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: tuple[str, int], payload: T) -> None:
        self.drop(key)
        n = self._size(payload)
        if n > self.max_item_bytes:
            return
        self._items[key] = (payload, n)
        self.bytes += n
        while self.bytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.bytes -= size
            self.dropped += 1

    def get(self, key: tuple[str, int]) -> T | None:
        item = self._items.get(key)
        return None if item is None else item[0]

    def drop(self, key: tuple[str, int]) -> T | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]


def json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` parsed, when it is a JSON object (else None)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def prefill_only(
    kind: ApiKind, body: bytes, members: Mapping[str, object] | None = None
) -> bytes | None:
    """A copy of ``body`` that asks for one token, not streamed (SGLang prefills and
    caches the whole prompt, then stops): ``max_tokens`` 1 (chat, completions) or
    ``sampling_params.max_new_tokens`` 1 (``/generate``), with ``members`` set (a DP
    rank). None when the body is no JSON object or the kind is not re-sent
    (embeddings)."""
    obj = json_object(body) if kind in PREWARM_PATHS else None
    if obj is None:
        return None
    for key in _DROPPED:
        obj.pop(key, None)
    obj["stream"] = False
    if kind is ApiKind.GENERATE:
        params = obj.get("sampling_params")
        params = dict(params) if isinstance(params, dict) else {}
        params["max_new_tokens"] = 1
        obj["sampling_params"] = params
    else:
        obj["max_tokens"] = 1
    obj.update(members or {})
    return orjson.dumps(obj)


# --- chains ----------------------------------------------------------------------------


@dataclass(slots=True)
class ChainEntry:
    """One chain a target was sent: its blocks and how recently and often it was used."""

    chain: Sequence[int]  # the request's block hashes (referenced, not copied)
    tokens: int  # the prompt's estimated tokens at its last use
    first_s: float  # first use of the conversation (its first turn)
    last_s: float  # last use (this chain, or one it extended)
    uses: int = 1  # dispatches of this chain or of chains it extends
    # leading blocks the target was believed to hold already when this chain was sent
    # there (the prefix it reused: a sibling's, a shared system prompt)
    reused: int = 0

    @property
    def leaf(self) -> int:
        return self.chain[-1]


@dataclass(slots=True)
class _Ring:
    entries: OrderedDict[int, ChainEntry] = field(default_factory=OrderedDict)
    blocks: int = 0


class ChainLog(Generic[T]):
    """Per target, the recent chains dispatched there (module docstring); with a
    :class:`PromptStore`, each chain's most recent prompt (``payload`` of the request:
    its body live, its token ids in the replay)."""

    def __init__(
        self,
        capacity_blocks: Callable[[str], int],
        *,
        max_chains: int = 1024,
        blocks_factor: float = 2.0,
        extend_scan: int = 128,
        store: PromptStore[T] | None = None,
        payload: Callable[[RouteRequest], T | None] | None = None,
    ) -> None:
        if max_chains <= 0 or blocks_factor <= 0 or extend_scan < 0:
            raise ValueError("max_chains and blocks_factor must be positive")
        self._capacity = capacity_blocks
        self.max_chains = max_chains
        self._factor = blocks_factor
        self._scan = extend_scan
        self.store = store
        self._payload = payload
        self._rings: dict[str, _Ring] = {}

    # -- recording (the routing core, at dispatch) ----------------------------------

    def dispatched(self, worker_id: str, req: RouteRequest, now: float, matched: int) -> None:
        """``req`` was dispatched to ``worker_id``, which was believed to hold its first
        ``matched`` blocks (``RoutingCore.dispatch``)."""
        if not req.block_hashes or req.batch or req.kind not in PREWARM_PATHS:
            return
        payload = None
        if self.store is not None and self._payload is not None:
            payload = self._payload(req)
        self.record(worker_id, req.block_hashes, req.prompt_tokens, now, payload, matched)

    def record(
        self,
        worker_id: str,
        chain: Sequence[int],
        tokens: int,
        now: float,
        payload: T | None = None,
        reused: int = 0,
    ) -> ChainEntry:
        """Log ``chain`` as used on ``worker_id`` at ``now`` (replacing the chain it
        extends, if any), ``reused`` of its blocks believed held there already."""
        ring = self._rings.get(worker_id)
        if ring is None:
            ring = self._rings[worker_id] = _Ring()
        entries, leaf = ring.entries, chain[-1]
        entry = entries.pop(leaf, None)
        if entry is not None:
            ring.blocks += len(chain) - len(entry.chain)
            entry.chain, entry.tokens, entry.last_s = chain, tokens, now
            entry.uses += 1
            entry.reused = max(entry.reused, reused)
        else:
            parent = self._parent(entries, chain)
            if parent is not None:
                old = self._pop(worker_id, ring, parent)
                entry = ChainEntry(chain, tokens, old.first_s, now, old.uses + 1, reused)
            else:
                entry = ChainEntry(chain, tokens, now, now, 1, reused)
            ring.blocks += len(chain)
        entries[leaf] = entry
        if payload is not None and self.store is not None:
            self.store.put((worker_id, leaf), payload)
        self._trim(worker_id, ring)
        return entry

    def _parent(self, entries: Mapping[int, ChainEntry], chain: Sequence[int]) -> int | None:
        """The last block of a logged chain this one extends (searched from its end)."""
        tail = chain[max(0, len(chain) - 1 - self._scan) : -1]
        if not entries or entries.keys().isdisjoint(tail):  # one C loop: the usual case
            return None
        return next(h for h in reversed(tail) if h in entries)

    def _pop(self, worker_id: str, ring: _Ring, leaf: int) -> ChainEntry:
        entry = ring.entries.pop(leaf)
        ring.blocks -= len(entry.chain)
        if self.store is not None:
            self.store.drop((worker_id, leaf))
        return entry

    def _trim(self, worker_id: str, ring: _Ring) -> None:
        budget = self._factor * self._capacity(worker_id)
        entries = ring.entries
        while len(entries) > 1 and (len(entries) > self.max_chains or ring.blocks > budget):
            self._pop(worker_id, ring, next(iter(entries)))

    def move(self, source: str, home: str, entry: ChainEntry, now: float) -> None:
        """A re-homed chain: out of ``source``'s log, into ``home``'s with its history
        and its prompt."""
        ring = self._rings.get(source)
        payload = self.payload(source, entry.leaf)
        if ring is not None and ring.entries.get(entry.leaf) is entry:
            self._pop(source, ring, entry.leaf)
        moved = self.record(home, entry.chain, entry.tokens, now, payload)
        moved.first_s, moved.last_s = entry.first_s, entry.last_s
        moved.uses = max(moved.uses - 1, entry.uses)
        moved.reused = entry.reused

    # -- reading ----------------------------------------------------------------------

    def entries(self, worker_id: str) -> list[ChainEntry]:
        """The target's logged chains, most recently used first."""
        ring = self._rings.get(worker_id)
        return [] if ring is None else list(reversed(ring.entries.values()))

    def get(self, worker_id: str, leaf: int) -> ChainEntry | None:
        ring = self._rings.get(worker_id)
        return None if ring is None else ring.entries.get(leaf)

    def payload(self, worker_id: str, leaf: int) -> T | None:
        return None if self.store is None else self.store.get((worker_id, leaf))

    def workers(self) -> list[str]:
        return list(self._rings)

    def stats(self) -> dict[str, int]:
        """Entries and blocks referenced, over every target; the store's bytes."""
        rings = self._rings.values()
        return {
            "chains": sum(len(r.entries) for r in rings),
            "blocks": sum(r.blocks for r in rings),
            "prompts": 0 if self.store is None else len(self.store),
            "prompt_bytes": 0 if self.store is None else self.store.bytes,
        }

    def forget_worker(self, worker_id: str) -> None:
        ring = self._rings.pop(worker_id, None)
        if ring is not None and self.store is not None:
            for leaf in ring.entries:
                self.store.drop((worker_id, leaf))


# --- the budget and the queue ------------------------------------------------------------


class TokenBudget:
    """A token bucket: by any time ``t``, at most ``burst + rate x (t - start)`` tokens
    were taken. A request larger than ``burst`` can never be taken."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now
        self.taken = 0.0

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def take(self, tokens: float, now: float) -> bool:
        self._refill(now)
        if tokens > self._tokens + 1e-6:  # (a float's rounding is no reason to wait)
            return False
        self._tokens -= tokens
        self.taken += tokens
        return True

    def wait_s(self, tokens: float, now: float) -> float:
        """Seconds until ``tokens`` can be taken (inf: never, over the burst)."""
        if tokens > self.burst:
            return math.inf
        self._refill(now)
        return max(0.0, (tokens - self._tokens) / self.rate)


@dataclass(slots=True)
class PrewarmJob:
    """One drain's or one join's pre-warming, and its figures (the report's)."""

    reason: str  # REASON_DRAIN or REASON_JOIN
    worker: str  # the drained worker, or the joining one
    deadline_s: float  # nothing is sent after this
    planned: int = 0
    sent: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0  # the conversation came back before its turn, or its prompt is gone
    dropped: int = 0  # still queued at the deadline, or over the budget's burst
    tokens_sent: int = 0  # budget units: tokens the home was believed not to hold
    tokens_reported: int = 0  # prompt tokens minus cached tokens the homes reported
    stopped: bool = False

    @property
    def queued(self) -> int:
        return self.planned - self.sent - self.skipped - self.dropped

    @property
    def in_flight(self) -> int:
        return self.sent - self.completed - self.failed

    @property
    def done(self) -> bool:
        return self.queued <= 0 and self.in_flight <= 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "planned": self.planned, "sent": self.sent, "completed": self.completed,
            "failed": self.failed, "skipped": self.skipped, "dropped": self.dropped,
            "queued": max(0, self.queued), "tokens_sent": self.tokens_sent,
            "tokens_reported": self.tokens_reported, "done": self.done,
            "stopped": self.stopped,
        }  # fmt: skip


@dataclass(slots=True)
class PrewarmItem:
    """One prefill-only request to send: ``chain`` to ``worker_id``, costing ``tokens``."""

    job: PrewarmJob
    worker_id: str  # the new home
    chain: Sequence[int]  # the blocks the prompt covers (recorded while in flight)
    tokens: int  # budget units (module docstring)
    last_s: float  # the chain's last use (hotter first)
    key: tuple[str, int]  # where its prompt is stored: (target id, leaf)
    prefix_blocks: int | None = None  # a join's shared prefix: the prompt cut to this


class PrewarmQueue:
    """Queued pre-warms of every drain and join, sent in order within one budget."""

    def __init__(
        self,
        budget: TokenBudget,
        max_in_flight: int = 2,
        max_home_queued_tokens: float = math.inf,
        busy_poll_s: float = 0.05,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be ≥ 1")
        if max_home_queued_tokens < 0 or busy_poll_s <= 0:
            raise ValueError("max_home_queued_tokens must be ≥ 0 and busy_poll_s positive")
        self.budget = budget
        self.max_in_flight = max_in_flight
        # a home whose queued prefill (live requests and pre-warms) is above this is busy:
        # its pre-warms wait, polled every busy_poll_s (module docstring)
        self.max_home_queued = max_home_queued_tokens
        self.busy_poll_s = busy_poll_s
        self._items: list[PrewarmItem] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, items: Iterable[PrewarmItem]) -> None:
        for item in items:
            item.job.planned += 1
            if item.tokens > self.budget.burst:
                item.job.dropped += 1  # never affordable
            else:
                self._items.append(item)

    def due(
        self,
        now: float,
        in_flight: Mapping[str, int],
        wanted: Callable[[PrewarmItem], bool],
        queued: Mapping[str, float] | None = None,
    ) -> list[PrewarmItem]:
        """The items to send now, in queue order: past their job's deadline (or its job
        stopped) dropped, no longer ``wanted`` skipped, a home at ``max_in_flight`` or
        busy (its ``queued`` prefill tokens above ``max_home_queued_tokens``) passed
        over; stops at the first the budget cannot pay yet."""
        out: list[PrewarmItem] = []
        busy = dict(in_flight)
        load = dict(queued or {})
        kept: list[PrewarmItem] = []
        blocked = False
        for item in self._items:
            job = item.job
            if blocked:
                kept.append(item)
            elif job.stopped or now > job.deadline_s:
                job.dropped += 1
            elif busy.get(item.worker_id, 0) >= self.max_in_flight or self._busy(item, load):
                kept.append(item)
            elif not wanted(item):
                job.skipped += 1
            elif self.budget.take(item.tokens, now):
                busy[item.worker_id] = busy.get(item.worker_id, 0) + 1
                if queued is not None:  # its lease will count it there
                    load[item.worker_id] = load.get(item.worker_id, 0.0) + item.tokens
                job.sent += 1
                job.tokens_sent += item.tokens
                out.append(item)
            else:
                blocked = True
                kept.append(item)
        self._items = kept
        return out

    def _busy(self, item: PrewarmItem, queued: Mapping[str, float]) -> bool:
        return queued.get(item.worker_id, 0.0) > self.max_home_queued

    def next_wake(
        self, now: float, in_flight: Mapping[str, int], queued: Mapping[str, float] | None = None
    ) -> float | None:
        """When :meth:`due` may next send something (None: nothing queued; ``now``: at
        once, e.g. to drop what is past its deadline); a busy home is polled every
        ``busy_poll_s`` (its queue drains without telling the queue)."""
        poll = None
        for item in self._items:
            if item.job.stopped or now > item.job.deadline_s:
                return now
            if in_flight.get(item.worker_id, 0) >= self.max_in_flight:
                continue
            if queued is not None and self._busy(item, queued):
                poll = min(now + self.busy_poll_s, item.job.deadline_s)
                continue
            wake = min(now + self.budget.wait_s(item.tokens, now), item.job.deadline_s)
            return wake if poll is None else min(wake, poll)
        return poll

    def stop(self, job: PrewarmJob) -> None:
        """Drop what ``job`` still has queued."""
        job.stopped = True
        kept = [i for i in self._items if i.job is not job]
        job.dropped += len(self._items) - len(kept)
        self._items = kept


# --- re-homing -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RehomeSettings:
    recent_s: float = 600.0  # chains used within this long are re-homed
    min_blocks: int = 4  # held there beyond anywhere else by at least this many blocks
    prewarm: bool = False  # queue pre-warms (needs a prompt store)
    prewarm_recent_s: float = 300.0  # only chains used within this long are pre-warmed
    # what of a chain is hot (reused): all of it once its conversation came back (used
    # this many times: a turn extending it), else the prefix it reused when it was sent
    min_uses: int = 2
    # ... and all of every chain when at least this share of the drained worker's recent
    # conversations came back (a chat fleet: the ones on their first turn will too)
    returning_share: float = 0.5
    # a home is given at most this many times an even share (over the candidates) of
    # the tokens the drain re-homes (inf, the default: by load alone)
    max_home_share: float = math.inf


@dataclass(slots=True)
class RehomeReport:
    """What one drain did with the drained worker's chains (``GET /workers/{id}/drain``)."""

    worker: str
    started_s: float
    considered: int = 0  # chains logged there
    rehomed: int = 0
    cold: int = 0  # not used within recent_s
    held_elsewhere: int = 0  # another candidate holds it (or all it still holds) already
    not_reused: int = 0  # its hot part (module docstring) is held elsewhere or too short
    returning_share: float = 0.0  # of its recent chains, those whose conversation came back
    no_home: int = 0  # no candidate to move it to
    tokens_rehomed: int = 0  # tokens of the re-homed chains the homes did not hold
    homes: dict[str, int] = field(default_factory=dict)  # new home -> chains
    job: PrewarmJob | None = None
    ended_s: float | None = None  # the drained worker left (removed), if it did

    def as_dict(self, now: float) -> dict[str, Any]:
        job = self.job
        end = self.ended_s if self.ended_s is not None else now
        return {
            "worker": self.worker,
            "chains_considered": self.considered,
            "chains_rehomed": self.rehomed,
            "chains_cold": self.cold,
            "chains_held_elsewhere": self.held_elsewhere,
            "chains_not_reused": self.not_reused,
            "returning_share": round(self.returning_share, 4),
            "chains_without_home": self.no_home,
            "tokens_rehomed": self.tokens_rehomed,
            "homes": dict(sorted(self.homes.items())),
            "prewarm": None if job is None else job.as_dict(),
            "done": job is None or job.done or self.ended_s is not None,
            "left": self.ended_s is not None,
            "elapsed_s": round(max(0.0, end - self.started_s), 3),
        }


def plan_rehome(
    log: ChainLog[Any],
    index: IndexView,
    drained: Sequence[str],
    loads: Mapping[str, float],
    now: float,
    settings: RehomeSettings,
    job: PrewarmJob | None = None,
) -> tuple[RehomeReport, list[PrewarmItem]]:
    """Re-home the chains of the ``drained`` targets onto the candidates of ``loads``
    (target id -> queued prefill tokens there now) and record them in ``index``; the
    pre-warms to queue, hottest first, when ``settings.prewarm`` and ``job`` (module
    docstring)."""
    report = RehomeReport(drained[0] if drained else "", now, job=job)
    gone = set(drained)
    # a home's load: its queued prefill, plus the conversations it holds (the tokens of
    # its chains used within recent_s: the work they will bring), plus what this drain
    # gives it
    load = {w: q + sum(e.tokens for e in log.entries(w) if now - e.last_s <= settings.recent_s)
            for w, q in loads.items()}  # fmt: skip
    pool = [(e, wid) for wid in drained for e in log.entries(wid)]
    pool.sort(key=lambda item: -item[0].last_s)
    recent = [e for e, _ in pool if now - e.last_s <= settings.recent_s]
    came_back = sum(1 for e in recent if e.uses >= settings.min_uses)
    returning = bool(recent) and came_back >= settings.returning_share * len(recent)
    report.returning_share = came_back / len(recent) if recent else 0.0
    items: list[PrewarmItem] = []
    moving: list[tuple[ChainEntry, str, int]] = []
    total = 0.0  # tokens to compute for them, at least (on their best home)
    for entry, source in pool:
        report.considered += 1
        if now - entry.last_s > settings.recent_s:
            report.cold += 1
            continue
        n = len(entry.chain)
        matches = index.match(entry.chain)
        held = matches.get(source, 0)
        elsewhere = max((b for w, b in matches.items() if w not in gone), default=0)
        whole = returning or entry.uses >= settings.min_uses
        hot = min(held, n if whole else entry.reused)
        if held - elsewhere < settings.min_blocks:
            report.held_elsewhere += 1
            continue
        if hot - elsewhere < settings.min_blocks:
            report.not_reused += 1
            continue
        if not load:
            report.no_home += 1
            continue
        moving.append((entry, source, hot))
        total += (hot - min(hot, elsewhere)) * index.block_tokens(source)
    # no home is given more than max_home_share x an even share of the tokens the
    # drain's chains need computed: the least loaded homes at the drain instant would
    # otherwise take every conversation (and their caches evict them)
    cap = settings.max_home_share * total / len(load) if load else math.inf
    given = dict.fromkeys(load, 0.0)
    for entry, source, hot in moving:
        n = len(entry.chain)
        matches = index.match(entry.chain)  # again: a sibling re-homed before counts

        def todo_of(wid: str, hot: int = hot, matches: Mapping[str, int] = matches) -> float:
            return (hot - min(hot, matches.get(wid, 0))) * index.block_tokens(wid)

        room = [w for w in load if given[w] == 0 or given[w] + todo_of(w) <= cap]
        home = min(room or load, key=lambda w: load[w] + todo_of(w))
        todo = round(todo_of(home))
        given[home] += todo
        load[home] += hot * index.block_tokens(home)
        blocks = entry.chain[:hot]
        index.record(blocks, home, now, pin=False)
        stored = log.payload(source, entry.leaf) is not None
        log.move(source, home, entry, now)
        report.rehomed += 1
        report.tokens_rehomed += todo
        report.homes[home] = report.homes.get(home, 0) + 1
        warm = now - entry.last_s <= settings.prewarm_recent_s
        if job is not None and settings.prewarm and stored and warm and todo > 0:
            cut = hot if hot < n else None  # the reused prefix of a chain: its prompt cut
            items.append(PrewarmItem(job, home, blocks, todo, entry.last_s,
                                     (home, entry.leaf), cut))  # fmt: skip
    return report, items


def still_wanted(log: ChainLog[Any], item: PrewarmItem) -> bool:
    """A queued pre-warm is still worth sending: its prompt is stored and, for a drain,
    the home's log still holds the chain as re-homed (no later turn extended it there)."""
    if item.job.reason == REASON_JOIN:
        return log.payload(*item.key) is not None
    entry = log.get(item.worker_id, item.key[1])
    return entry is not None and entry.last_s <= item.last_s and log.payload(*item.key) is not None


def shared_prefixes(
    log: ChainLog[Any],
    index: IndexView,
    workers: Sequence[str],
    now: float,
    recent_s: float,
    count: int,
    *,
    min_blocks: int = 2,
    per_worker: int = 64,
) -> list[tuple[Sequence[int], tuple[str, int], int]]:
    """Up to ``count`` of the fleet's most shared prefixes: (blocks, where a prompt
    containing them is stored, uses), most widely held first. A prefix is the longest
    one of a recent chain (used within ``recent_s``, one of the ``per_worker`` most
    recent of each worker) that at least half of ``workers`` (and two) are believed to
    hold; ranked by its holders, then by the uses of the chains that share it."""
    if count <= 0 or len(workers) < 2:
        return []
    need = max(2, math.ceil(len(workers) / 2))
    alive = set(workers)
    found: dict[int, list[Any]] = {}  # shared prefix's last block -> [blocks, key, holders, uses]
    for wid in workers:
        for entry in log.entries(wid)[:per_worker]:
            if now - entry.last_s > recent_s or log.payload(wid, entry.leaf) is None:
                continue
            lengths = sorted((b for w, b in index.match(entry.chain).items() if w in alive),
                             reverse=True)  # fmt: skip
            if len(lengths) < need or lengths[need - 1] < min_blocks:
                continue
            n = lengths[need - 1]
            holders = sum(1 for b in lengths if b >= n)
            leaf = entry.chain[n - 1]
            known = found.get(leaf)
            if known is None:
                found[leaf] = [entry.chain[:n], (wid, entry.leaf), holders, entry.uses]
            else:
                known[2] = max(known[2], holders)
                known[3] += entry.uses
    ranked = sorted(found.values(), key=lambda f: (-f[2], -f[3], -len(f[0])))
    return [(f[0], f[1], f[3]) for f in ranked[:count]]


def join_items(
    log: ChainLog[Any],
    index: IndexView,
    joining: str,
    workers: Sequence[str],
    now: float,
    recent_s: float,
    count: int,
    job: PrewarmJob,
) -> list[PrewarmItem]:
    """The pre-warms of a joining target: the fleet's most shared prefixes it is not
    believed to hold (:func:`shared_prefixes`, among ``workers``, the others)."""
    others = [w for w in workers if w != joining]
    items = []
    for blocks, key, _ in shared_prefixes(log, index, others, now, recent_s, count):
        held = index.match(blocks).get(joining, 0)
        todo = round((len(blocks) - held) * index.block_tokens(joining))
        if todo > 0:
            items.append(PrewarmItem(job, joining, blocks, todo, now, key, len(blocks)))
    return items
