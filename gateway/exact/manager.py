"""Exact mode: follow the workers' KV-cache events (SGLANG_API.md §4), know when to stop.

:class:`KVEventsManager` discovers each worker's ``kv_events`` descriptor from
``/server_info`` (:mod:`gateway.exact.wire`), runs one feed per DP rank
(:mod:`gateway.exact.feed`), applies the events to the exact index and confirms predicted
blocks (:mod:`gateway.exact.index`), tracks each worker's **mode** and answers
:meth:`KVEventsManager.match` for the workers in exact mode. Requests reach it through
:class:`gateway.exact.request.ExactRequest` (:meth:`KVEventsManager.prepare`).

Which workers are followed: SGLang workers whose ``/server_info`` advertises events and
whose model has a tokenizer (:mod:`gateway.exact.choice`); every other worker is
approximate, and :meth:`KVEventsManager.reason` says why (logged once per change).
The ZMQ sockets connect only where the worker is: the descriptor's host (wildcard
substituted) must be the worker URL's own (:func:`gateway.exact.wire.same_host`) or pass
the allow-list the gateway applies to worker URLs (``server.worker_allowlist``); a
worker pointing elsewhere is not followed.

Modes, per worker: ``approximate`` (no events configured or discoverable), ``exact``
(events flowing), ``degraded`` (events configured but a request dispatched there saw no
event within ``stale_timeout_s``, or a gap could not be filled). An idle worker publishes
nothing, so silence alone is not staleness: only silence *after a dispatch* is. The
router uses the approximate prefix index for any worker not in exact mode, so a stopped
publisher degrades to the approximate behaviour, visibly, and the return is automatic.

Hybrid (``hybrid``): a request dispatched to an exact-mode worker records its blocks as
predicted entries, so siblings of a prompt still in prefill co-locate; the event that
stores them confirms them (TTL and its trade-off: :mod:`gateway.exact.index`).

Events are keyed by the routing target they describe: a DP rank's own target when the
registry routes to that rank (``rank_targets``), else the worker, its ranks unioned (a
rank-blind worker, ``dp_aware: false``).

Fidelity: per (worker, mode), predicted vs reported cached tokens of finished requests.

Cost: a match hashes the request once per distinct block size, then one set lookup per
leading block per exact-mode worker; discovery is one ``/server_info`` GET per worker per
``discovery_interval_s``. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq.asyncio

from gateway.config import KVEventsConfig
from gateway.config.allowlist import HostAllowList, NotAllowed
from gateway.config.workerspec import rank_target_id, routed_ranks, split_target_id
from gateway.exact.choice import NO_TOKENIZER, TokenizerChoice, load_worker_cached
from gateway.exact.feed import RankFeed
from gateway.exact.index import ExactIndex, Namespace, PredictedBlocks, chain_hashes, namespace_seed
from gateway.exact.request import ExactRequest
from gateway.exact.tokenizer import Tokenizer
from gateway.exact.wire import Descriptor, Event, same_host

log = logging.getLogger(__name__)

MODE_EXACT = "exact"
MODE_APPROXIMATE = "approximate"
MODE_DEGRADED = "degraded"
MODES = (MODE_EXACT, MODE_APPROXIMATE, MODE_DEGRADED)
# A worker-named tokenizer file larger than this is not read (real tokenizer.json files
# are under 40 MB).
MAX_WORKER_FILE_BYTES = 64 << 20
# Worker-controlled text quoted in a reason (shown in /workers, logged) is cut to this.
MAX_QUOTED = 160
# Threads tokenizing large request bodies off the event loop (more queue behind them).
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)

# The ``kv_events:`` config section, as the manager takes it (defaults and their reasons
# in gateway/config/__init__.py).
KVEventsSettings = KVEventsConfig


@dataclass(frozen=True, slots=True)
class FollowedWorker:
    """A worker as the manager is told of it (``workers()``): where, what kind, what model."""

    id: str
    url: str
    kind: str = "sglang"
    models: frozenset[str] = frozenset()  # every name it serves under


@dataclass(slots=True)
class _WorkerState:
    desc: Descriptor | None = None
    startup: Any = None
    feeds: list[RankFeed] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    awaiting_since: float | None = None  # first dispatch not yet followed by an event
    degraded_until: float = 0.0  # after an unfillable gap
    tokenizer: Tokenizer | None = None
    from_worker: bool = False  # the tokenizer is the one its /server_info names
    named: tuple[Any, Any] | None = None  # (tokenizer_path, chat_template) it named last
    why: str = "waiting for its first /server_info"  # while approximate
    lost_at: float | None = None  # last unfillable gap


@dataclass(slots=True)
class Fidelity:
    """Predicted vs reported cached tokens, cumulative, for one (worker, mode)."""

    requests: int = 0
    predicted_tokens: int = 0
    true_predicted_tokens: int = 0  # Σ min(predicted, reported): precision numerator
    reported_tokens: int = 0


class KVEventsManager:
    """Discovery, feeds, modes and exact matching for a set of workers (module docstring).

    ``workers()`` lists the workers (:class:`FollowedWorker`); the manager re-reads it
    and ``/server_info`` every ``discovery_interval_s``. ``tokenizers``: one tokenizer
    for every model, or a :class:`~gateway.exact.choice.TokenizerChoice` per model.
    ``allowlist``: where else than a worker's own host its events may be read from
    (None: nowhere else).
    """

    def __init__(
        self,
        settings: KVEventsSettings,
        tokenizers: Tokenizer | TokenizerChoice,
        workers: Callable[[], Iterable[FollowedWorker]],
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
        allowlist: HostAllowList | None = None,
        rank_targets: Callable[[str], int] | None = None,
        host_tier: bool = True,
    ) -> None:
        self.settings = settings
        # how many DP rank targets the registry routes a worker as (None: as many as its
        # descriptor tells, up to MAX_ROUTED_DP_RANKS: the offline replay's rule)
        self._rank_targets = rank_targets
        self.tokenizers = (
            tokenizers if isinstance(tokenizers, TokenizerChoice) else TokenizerChoice(tokenizers)
        )
        # host_tier: HiCache's host copies are a tier of their own (False: GPU events only)
        self.index = ExactIndex(host_tier)
        self.predicted = PredictedBlocks(
            settings.ttl_factor, settings.ttl_min_s, settings.ttl_max_s
        )
        self._workers = workers
        self._allowlist = allowlist
        self._session = session
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._states: dict[str, _WorkerState] = {}  # the SGLang workers with a tokenizer
        self._unfollowed: dict[str, str] = {}  # every other worker: why
        self._discovery: asyncio.Task[None] | None = None
        # threads start on first use: a gateway that never sees a large body starts none
        self._tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="exact-tokenize")
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
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # discovery must never stop; the next round retries
                log.exception("kv events: discovery failed")

    async def discover(self) -> None:
        """Subscribe to new workers, drop removed ones, resubscribe restarted ones."""
        current: dict[str, FollowedWorker] = {}
        listed = list(self._workers())
        for w in listed:
            tokenizer, why = self.tokenizers.for_models(w.models)
            from_worker = why == NO_TOKENIZER and self.settings.tokenizer_from_workers
            if w.kind != "sglang":
                why = f"a {w.kind} worker publishes no KV events"
            elif from_worker:
                why = None  # its /server_info may name a local tokenizer directory
            if why is None:
                current[w.id] = w
                state = self._states.setdefault(w.id, _WorkerState())
                if not from_worker:
                    state.tokenizer, state.from_worker = tokenizer, False
                elif not state.from_worker:
                    state.tokenizer, state.from_worker = None, True
                self._unfollowed.pop(w.id, None)
            elif self._unfollowed.get(w.id) != why:
                self._unfollowed[w.id] = why
                log.info("kv events: worker %s stays approximate: %s", w.id, why)
        ids = {w.id for w in listed}
        for wid in [w for w in self._unfollowed if w not in ids]:
            del self._unfollowed[wid]
        for wid in [w for w in self._states if w not in current]:
            await self._unsubscribe(wid)
            self.index.clear(wid)
            self.predicted.forget(wid)
            del self._states[wid]
        infos = await asyncio.gather(*(self._server_info(w.url) for w in current.values()))
        for w, info in zip(current.values(), infos, strict=True):
            state = self._states[w.id]
            if isinstance(info, str):
                self._note(w.id, state, info)
                continue
            try:
                await self._follow(w, state, info)
            except Exception as exc:  # a malformed /server_info: this worker only
                why = f"its /server_info is unusable ({type(exc).__name__})"
                await self._stop_following(w.id, state, why)

    async def _follow(self, w: FollowedWorker, state: _WorkerState, info: dict[str, Any]) -> None:
        """Apply one worker's ``/server_info``: its tokenizer (if it names it), then its
        descriptor (subscribing again when it or the worker's start time changed)."""
        named = (info.get("tokenizer_path"), info.get("chat_template"))
        if state.from_worker and (state.tokenizer is None or named != state.named):
            found = await self._worker_tokenizer(info)  # once per directory it names
            state.named = named
            if isinstance(found, str):
                state.tokenizer = None
                await self._stop_following(w.id, state, found)
                return
            state.tokenizer = found
        desc = Descriptor.parse(info.get("kv_events") or {}, w.url)
        refused = None if desc is None else await self._elsewhere(desc.host, w.url)
        if refused is not None:
            await self._stop_following(w.id, state, refused)
            return
        startup = info.get("startup_time")
        if desc == state.desc and startup == state.startup:
            return
        await self._unsubscribe(w.id)
        self.index.clear(w.id)
        state.desc, state.startup, state.awaiting_since = desc, startup, None
        if desc is not None:
            self._subscribe(w.id, state, desc)
            log.info(
                "kv events: following worker %s (%d rank feeds, page %d)",
                w.id, desc.dp_size, desc.block_size,
            )  # fmt: skip
        else:
            self._note(w.id, state, "its /server_info advertises no kv_events")

    async def _stop_following(self, wid: str, state: _WorkerState, why: str) -> None:
        """No more events from this worker (for now): feeds closed, its blocks forgotten,
        ``why`` its reason."""
        await self._unsubscribe(wid)
        self.index.clear(wid)
        state.desc = state.startup = None
        self._note(wid, state, why)

    async def _elsewhere(self, host: str, worker_url: str) -> str | None:
        """None if the gateway may connect to ``host`` for this worker's events (its own
        host, or allowed as a worker URL would be), else the reason it may not."""
        if same_host(host, worker_url):
            return None
        if self._allowlist is not None:
            literal = f"[{host}]" if ":" in host else host
            try:
                await self._allowlist.check(f"tcp://{literal}")
                return None
            except (NotAllowed, ValueError):
                pass
        return (
            f"its kv_events endpoint host {_quoted(host)} is not the worker's host and not allowed"
        )

    async def _worker_tokenizer(self, info: dict[str, Any]) -> Tokenizer | str:
        """The tokenizer a worker's ``/server_info`` names, when it is a local directory
        (the gateway beside its workers, or shared model storage), else why not.
        Loaded once per directory, off the event loop; never downloaded."""
        return await asyncio.to_thread(_named_tokenizer, info, self.settings.max_render_s)

    def _note(self, wid: str, state: _WorkerState, why: str) -> None:
        if state.desc is None and state.why != why:
            log.info("kv events: worker %s stays approximate: %s", wid, why)
        state.why = why

    async def _server_info(self, url: str) -> dict[str, Any] | str:
        """The worker's ``/server_info``, or why there is none."""
        try:
            timeout = aiohttp.ClientTimeout(total=2.0)
            async with self._session.get(
                f"{url}/server_info", timeout=timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return f"its /server_info answered HTTP {resp.status}"
                body = orjson.loads(await resp.read())
                return body if isinstance(body, dict) else "its /server_info is not an object"
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            return f"no /server_info ({type(exc).__name__})"

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

    def follow(self, worker_id: str, desc: Descriptor, tokenizer: Tokenizer | None = None) -> None:
        """Follow a worker whose descriptor is known without discovery, its batches handed
        to :meth:`apply_batch` by the caller rather than read from ZMQ (the offline replay,
        which drives workers in virtual time)."""
        self._states[worker_id] = _WorkerState(desc=desc, tokenizer=tokenizer)

    def apply_batch(self, worker_id: str, rank: int, ts: float, events: list[Event]) -> None:
        """One decoded batch of a followed worker, as its feed would hand it."""
        self._apply(worker_id, rank, ts, events)

    # events ------------------------------------------------------------------
    def _apply(self, wid: str, rank: int, ts: float, events: list[Event]) -> None:
        state = self._states.get(wid)
        if state is None or state.desc is None:
            return
        now = self._clock()
        state.awaiting_since = None
        target = self._target(wid, rank, state.desc)
        for event in events:
            stored = self.index.apply(target, rank, event, state.desc.block_size)
            if stored:
                self.predicted.confirm(target, stored, now)

    def _gap_lost(self, wid: str, rank: int) -> None:
        state = self._states.get(wid)
        desc = None if state is None else state.desc
        self.index.clear(wid if desc is None else self._target(wid, rank, desc), rank)
        state = self._states.get(wid)
        if state is not None:
            state.lost_at = self._clock()
            state.degraded_until = state.lost_at + self.settings.stale_timeout_s
        log.warning("kv events: worker %s rank %d lost batches replay could not fill", wid, rank)

    def _target(self, wid: str, rank: int, desc: Descriptor) -> str:
        """The routing target a rank's events describe: the rank's own target id when the
        registry routes to it (``Worker.ranks``), else the worker."""
        if self._rank_targets is None:
            routed = routed_ranks(desc.dp_size)
        else:
            routed = self._rank_targets(wid)
        return rank_target_id(wid, rank) if rank < routed else wid

    # modes and matching ------------------------------------------------------
    def _state(self, target_id: str) -> _WorkerState | None:
        """A followed worker's state, by its id or one of its DP ranks' target ids."""
        state = self._states.get(target_id)
        return state if state is not None else self._states.get(split_target_id(target_id)[0])

    def mode(self, worker_id: str) -> str:
        state = self._state(worker_id)
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

    def reason(self, worker_id: str) -> str:
        """Why the worker is in its mode, in words for an operator."""
        state = self._state(worker_id)
        if state is None:
            return self._unfollowed.get(split_target_id(worker_id)[0], "not yet discovered")
        mode = self.mode(worker_id)
        if mode == MODE_APPROXIMATE:
            return state.why
        if mode == MODE_DEGRADED:
            if self._clock() < state.degraded_until:
                return "lost KV-event batches that replay could not fill; back after a pause"
            return (
                f"no KV event within {self.settings.stale_timeout_s:g} s of a dispatch: "
                "the approximate index routes it until events flow again"
            )
        assert state.desc is not None
        d = state.desc
        return f"following its KV events (tcp://{d.host}:{d.port_base}, page {d.block_size})"

    def tokenizer_for(self, worker_id: str) -> Tokenizer | None:
        """The tokenizer of a followed worker's model (None: not followed)."""
        state = self._state(worker_id)
        return None if state is None else state.tokenizer

    def block_size(self, worker_id: str) -> int | None:
        state = self._state(worker_id)
        return state.desc.block_size if state is not None and state.desc is not None else None

    def request_hashes(
        self, ids: Sequence[int], namespace: Namespace, block_size: int
    ) -> list[int]:
        return chain_hashes(ids, block_size, namespace_seed(*namespace))

    def match(
        self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Iterable[str]
    ) -> dict[str, int]:
        """Matched **tokens** for every given worker in exact mode (0 included): the
        leading blocks the worker holds, at most ``(len(ids) - 1) // block_size`` of them,
        as SGLang's ``cached_tokens`` (an exact repeat of a 32-token prompt hits 16 on
        page 16, not 32)."""
        return {w: t for w, (t, _) in self.match_tiers(ids, namespace, worker_ids).items()}

    def match_tiers(
        self, ids: Sequence[int] | None, namespace: Namespace, worker_ids: Iterable[str]
    ) -> dict[str, tuple[int, int]]:
        """:meth:`match`, each with the part on the worker's host tier: (matched tokens,
        of them on the host). The GPU part is the leading blocks held on the GPU (or
        predicted there: the hybrid); the host part continues it with blocks held on the
        host tier, which SGLang loads back (docs/KV_EVENTS.md, "With HiCache")."""
        out: dict[str, tuple[int, int]] = {}
        now = self._clock()
        hashes_by_size: dict[int, list[int]] = {}
        for wid in worker_ids:
            size = self.block_size(wid)
            if size is None or self.mode(wid) != MODE_EXACT:
                continue
            if ids is None or namespace[2]:  # extra_key is not in events: never claim a hit
                out[wid] = (0, 0)
                continue
            hashes = hashes_by_size.get(size)
            if hashes is None:
                hashes = hashes_by_size[size] = self.request_hashes(ids, namespace, size)
            n = 0
            # SGLang computes at least the prompt's last token: a hit covers at most
            # len - 1 tokens, in whole blocks (cached_tokens' semantics)
            usable = hashes[: (len(ids) - 1) // size]
            for h in usable:
                if not (
                    self.index.holds(wid, h)
                    or (self.settings.hybrid and self.predicted.holds(wid, h, now))
                ):
                    break
                n += 1
            host = 0
            for h in usable[n:]:
                if not self.index.holds_host(wid, h):
                    break
                host += 1
            out[wid] = ((n + host) * size, host * size)
        return out

    def dispatched(self, worker_id: str, ids: Sequence[int] | None, namespace: Namespace) -> None:
        """A request went to ``worker_id``: expect an event if it brings the worker a
        block it does not hold (a prompt already cached whole stores nothing, so its
        silence is no staleness); predict its blocks (hybrid)."""
        state = self._state(worker_id)
        if state is None or state.desc is None:
            return
        now = self._clock()
        hashes = None
        if ids is not None and not namespace[2]:
            hashes = self.request_hashes(ids, namespace, state.desc.block_size)
        stores = hashes is None or not all(self.index.holds(worker_id, h) for h in hashes)
        if stores and state.awaiting_since is None:
            state.awaiting_since = now
        if self.settings.hybrid and hashes is not None:
            self.predicted.record(worker_id, hashes, now)

    def prepare(self, kind: str, body: bytes) -> ExactRequest:
        """A request for matching and dispatch (``kind``: an ApiKind value), tokenized at
        most once and only if some worker needs its tokens (a large body in this
        manager's threads), and never when the body is over ``max_tokenize_bytes`` (the
        approximate index routes it)."""
        return ExactRequest(
            self, kind, body, self.settings.max_tokenize_bytes, executor=self._tokenize
        )

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


def _quoted(value: Any) -> str:
    """A worker-controlled value for a reason or a log line: repr (no raw newline), cut."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED else text[: MAX_QUOTED - 3] + "..."


def _named_tokenizer(info: dict[str, Any], render_budget_s: float) -> Tokenizer | str:
    """The tokenizer a worker's ``/server_info`` names, or why not. Worker-controlled:
    absolute paths only, resolved (one cache entry per real directory and template, not
    per spelling), files of bounded size, and a failure named by its type only (an
    exception's message may quote the file, e.g. a template's line)."""
    path, template = info.get("tokenizer_path"), info.get("chat_template")
    try:
        directory = _local_file(path, "tokenizer.json")
        if directory is None:
            return (
                f"{NO_TOKENIZER}, and the tokenizer_path its /server_info names "
                f"({_quoted(path)}) is not a local directory with a tokenizer.json"
            )
        template_file = None
        if template is not None:
            template_file = _local_file(template, None)
            if template_file is None:
                return (
                    f"it renders chats with its own --chat-template {_quoted(template)}, "
                    "not a local file"
                )
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            f = directory / name
            if f.is_file() and f.stat().st_size > MAX_WORKER_FILE_BYTES:
                return f"the tokenizer at {_quoted(path)} is too large ({name})"
        return load_worker_cached(str(directory), str(template_file or ""), render_budget_s)
    except Exception as exc:  # ImportError, OSError, ValueError, the tokenizer's own
        return f"the tokenizer at {_quoted(path)} could not be loaded ({type(exc).__name__})"


def _local_file(value: Any, inside: str | None) -> Path | None:
    """``value`` resolved, if it is an absolute path to a regular file of bounded size
    (``inside``: to a directory holding that file; the directory is returned)."""
    if not (isinstance(value, str) and value and Path(value).is_absolute()):
        return None
    resolved = Path(value).resolve()
    target = resolved / inside if inside else resolved
    if not target.is_file() or target.stat().st_size > MAX_WORKER_FILE_BYTES:
        return None
    return resolved
