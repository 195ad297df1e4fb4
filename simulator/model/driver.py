"""Drives a worker model (:class:`DrivenModel`) in real time on the event loop; hands
outputs to handlers.

One asyncio task per worker loops ``step → sleep(duration / speed) → deliver``. Idle, it
waits on a future that ``submit``/``abort`` resolve, so an idle worker costs nothing and
many workers share one loop cheaply.

Modelled time is ``(loop.time() - t0) * speed``. A step starts at the end of the previous
one while the loop keeps up (timer jitter below ``_JITTER_WALL_S`` is absorbed, so the
modelled schedule stays exact); if the loop falls further behind, the model resyncs to
the clock instead of pretending to be on time.

Handlers hold a :class:`RequestHandle` per request: the driver folds each output into it
and wakes the handler, which reads the latest cumulative state (so a slow reader gets
coalesced updates, like SGLang's tokenizer manager).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from simulator.model.radix_cache import TOKEN_BYTES
from simulator.model.requests import Finish, RequestOutput, SimRequest, StepResult

_JITTER_WALL_S = 0.005
_MIN_SLEEP_WALL_S = 0.001


class DrivenModel(Protocol):
    """What the driver needs of a worker model: :class:`simulator.model.radix_worker.WorkerModel`
    (SGLang) and :class:`simulator.model.slots.SlotWorkerModel` (llama.cpp)."""

    def submit(self, req: SimRequest, now: float) -> None: ...
    def abort(self, rid: str, now: float) -> None: ...
    def has_request(self, rid: str) -> bool: ...
    def step(self, now: float) -> StepResult | None: ...


class RequestHandle:
    """The cumulative state of one in-flight request, as the HTTP layer sees it."""

    __slots__ = (
        "_loop",
        "_seen",
        "_version",
        "_waiter",
        "arrival",
        "cached_host",
        "cached_tokens",
        "completion_tokens",
        "dp_rank",
        "finish",
        "finish_time",
        "first_token_time",
        "log_metrics",
        "output_ids",
        "prompt_tokens",
        "received_ts",
        "rid",
        "stream",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        stream: bool,
        log_metrics: bool,
        arrival: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.log_metrics = log_metrics
        self.arrival = arrival
        self.received_ts = time.time()  # wall clock, for /generate's stamps
        self.cached_tokens = 0
        self.cached_host = 0  # of cached_tokens, loaded from the host tier (HiCache)
        self.completion_tokens = 0
        self.dp_rank: int | None = None  # the serving DP rank, set by a server with ranks
        self.output_ids: list[int] | tuple[int, ...] = ()
        self.finish: Finish | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._loop = loop
        self._version = 0
        self._seen = 0
        self._waiter: asyncio.Future[None] | None = None

    def update(self, out: RequestOutput) -> None:
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.cached_host = out.cached_host
        self.output_ids = out.output_ids  # type: ignore[assignment]
        if out.first_token and self.first_token_time is None:
            self.first_token_time = out.time
        if out.finish is not None:
            self.finish = out.finish
            self.finish_time = out.time
        self._version += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self, finish: Finish) -> None:
        """End the request without the model (worker stopping)."""
        if self.finish is None:
            self.finish = finish
            self._version += 1
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once there is something new since the previous ``wait``."""
        if self._version == self._seen:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._seen = self._version

    @property
    def done(self) -> bool:
        return self.finish is not None


OutputObserver = Callable[[RequestHandle, RequestOutput], None]


class ModelDriver:
    """Runs one model on the loop's clock; see module docstring."""

    def __init__(
        self,
        engine: DrivenModel,
        speed: float,
        observer: OutputObserver | None = None,
    ) -> None:
        self.engine = engine
        self.speed = speed
        self._observer = observer
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_step: StepResult | None = None
        self.activity: list[asyncio.Future[None]] = []  # resolved at the next delivery

    def now(self) -> float:
        """Modelled time now."""
        return (self._loop.time() - self._t0) * self.speed

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in list(self._handles.values()):
            handle.close(Finish("abort", handle.completion_tokens, message="Worker stopped"))
        self._handles.clear()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def get(self, rid: str) -> RequestHandle | None:
        return self._handles.get(rid)

    def submit(self, req: SimRequest, *, log_metrics: bool = True) -> RequestHandle:
        """Queue ``req``; raises ValueError (duplicate rid, prompt too long for the pool)."""
        now = self.now()
        if req.rid in self._handles:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        self.engine.submit(req, now)
        prompt = req.prompt_ids
        prompt_tokens = len(prompt) // TOKEN_BYTES if isinstance(prompt, bytes) else len(prompt)
        handle = RequestHandle(req.rid, prompt_tokens, req.stream, log_metrics, now, self._loop)
        self._handles[req.rid] = handle
        self._wake()
        return handle

    def abort(self, rid: str) -> bool:
        """Abort ``rid`` if in flight; its handle finishes with the next delivery."""
        handle = self._handles.get(rid)
        if handle is None or handle.done or not self.engine.has_request(rid):
            return False  # unknown, or finished and waiting to be delivered
        self.engine.abort(rid, self.now())
        self._wake()
        return True

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _run(self) -> None:
        loop = self._loop
        engine = self.engine
        prev_end: float | None = None
        jitter = _JITTER_WALL_S * self.speed
        while True:
            now = self.now()
            if prev_end is not None and now < prev_end + jitter:
                now = prev_end  # on schedule: absorb timer jitter, never start early
            result = engine.step(now)
            # idle, or idle for a while (a LoRA adapter loading): a submit wakes it sooner
            if result is None or (result.kind == "idle" and result.duration > 0):
                timeout = None
                if result is not None:
                    self._deliver(result)
                    timeout = result.duration / self.speed
                prev_end = None
                self._wakeup = loop.create_future()
                try:
                    await asyncio.wait((self._wakeup,), timeout=timeout)
                finally:
                    self._wakeup = None
                continue
            self.last_step = result
            # Sleep only when the model is ahead of the clock by more than a timer tick:
            # shorter sleeps round to the loop's 1 ms timer resolution anyway, and each one
            # costs a wake-up. Always yield, so that handlers write between steps.
            delay = self._t0 + result.end / self.speed - loop.time()
            await asyncio.sleep(delay if delay > _MIN_SLEEP_WALL_S else 0)
            self._deliver(result)
            prev_end = result.end

    def _deliver(self, result: StepResult) -> None:
        handles = self._handles
        observer = self._observer
        for out in result.outputs:
            handle = handles.get(out.rid)
            if handle is None:
                continue
            handle.update(out)
            if observer is not None:
                observer(handle, out)
            if out.finish is not None:
                del handles[out.rid]
        if self.activity:
            waiters, self.activity = self.activity, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
