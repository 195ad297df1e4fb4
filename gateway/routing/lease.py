"""The in-flight lease: a guard that counts one request on one worker for as long as its
response body lives.

Contract: creating a :class:`Lease` adds the request to the worker's ``in_flight`` and its
uncached prompt tokens to ``queued_prefill_tokens``; :meth:`first_token` moves it from the
prefill queue to ``decoding_requests``; :meth:`release` undoes whatever is still counted
and is idempotent, so every exit path (normal end, worker failure, client disconnect,
cancellation) may call it and the counters are released exactly once.
"""

from __future__ import annotations

from types import TracebackType

from gateway.workers.registry import Worker

_QUEUED = 0
_DECODING = 1
_RELEASED = 2


class Lease:
    __slots__ = ("_prefill_tokens", "_state", "queued_ahead", "worker")

    def __init__(self, worker: Worker, prefill_tokens: int) -> None:
        self.worker = worker
        self._prefill_tokens = prefill_tokens
        self._state = _QUEUED
        # prefill work already queued there when this request arrived (cost model input)
        self.queued_ahead = worker.queued_prefill_tokens
        worker.in_flight += 1
        worker.queued_prefill_tokens += prefill_tokens

    @property
    def released(self) -> bool:
        return self._state == _RELEASED

    def first_token(self) -> None:
        if self._state == _QUEUED:
            self.worker.queued_prefill_tokens -= self._prefill_tokens
            self.worker.decoding_requests += 1
            self._state = _DECODING

    def release(self) -> None:
        if self._state == _RELEASED:
            return
        worker = self.worker
        if self._state == _QUEUED:
            worker.queued_prefill_tokens -= self._prefill_tokens
        else:
            worker.decoding_requests -= 1
        worker.in_flight -= 1
        self._state = _RELEASED

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
