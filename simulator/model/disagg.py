"""SGLang's prefill and decode roles as worker models (PD disaggregation, docs/PD.md).

Both extend :class:`simulator.model.radix_worker.WorkerModel` and keep its driver
contract; what a bootstrap room is and when its partner shows up is the HTTP layer's
business (:mod:`simulator.http.sglang.pd`), which tells the model through the methods
below and then wakes the model's driver.

**Prefill** (:class:`PrefillWorkerModel`), as ``disaggregation/prefill.py``:

* a request announced with :meth:`PrefillWorkerModel.expect` is submitted with
  ``max_new_tokens`` 1 and waits in the **bootstrap queue**, outside the scheduler, until
  :meth:`~PrefillWorkerModel.bootstrapped` (its decode side connected) or
  :meth:`~PrefillWorkerModel.fail` (bootstrap timeout);
* then it is scheduled like any request: its ``cached_tokens`` are the radix cache's real
  prefix hit, it is prefilled (chunked if long) and samples one token;
* instead of finishing it enters the **inflight queue** with its KV still locked in the
  tree while the KV moves over the server's :class:`~simulator.model.transfer.TransferLink`
  (every prompt token, cached or not); when the transfer is done it finishes with
  SGLang's ``FINISH_LENGTH(length=0)`` and its one token, or, if the HTTP layer drew a
  transfer failure for it, with a 500 abort carrying SGLang's message.

**Decode** (:class:`DecodeWorkerModel`), as ``disaggregation/decode.py``:

* a request announced with :meth:`DecodeWorkerModel.expect` waits outside the scheduler,
  first in the **prealloc queue** (the handshake with the prefill's bootstrap server),
  then, after :meth:`~DecodeWorkerModel.bootstrapped`, in the **transfer queue**;
* :meth:`~DecodeWorkerModel.kv_arrived` commits it: KV slots for the whole prompt are
  taken (evicting, or waiting for room), ``cached_tokens`` is the prefill's (SGLang sends
  it in the metadata buffer), the prefill's token is its first output token, and it joins
  the running batch without a prefill step ("prebuilt"); the next decode step streams
  the handoff token and the first decoded one together;
* :meth:`~DecodeWorkerModel.fail` ends it with a 500 abort (handshake failure, transfer
  failure, waiting timeout, lost prefill);
* its finished sequences are not kept in the tree: a decode server's radix cache is off
  by default (``disable_radix_cache``).

Not modelled: a decode-side radix cache, KV sent chunk by chunk during a long prefill
(the transfer starts when the prompt is complete), the decode's preallocation before the
transfer (slots are taken when the KV arrives), the decode NIC's own queue, and SGLang's
PD retraction (a retracted decode request is prefilled again locally).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from simulator.model.radix_cache import CacheListener
from simulator.model.radix_state import ReqState
from simulator.model.radix_worker import WorkerModel
from simulator.model.requests import (
    Finish,
    OutputTokenizer,
    RequestOutput,
    SimRequest,
    StepResult,
)
from simulator.model.settings import WorkerSettings
from simulator.model.transfer import TransferLink, TransferProfile, get_transfer_profile

MODES = ("null", "prefill", "decode")
# SGLang 0.5.23's DISAGG_TRANSFER_BACKEND_CHOICES, and mooncake_tcp (rewritten to mooncake)
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")


def check_disaggregation(
    mode: str,
    backend: str,
    bootstrap_port: int,
    transfer_profile: str,
    timeouts: tuple[float, float],
    unsupported: bool,
) -> None:
    """The PD settings' checks (``ValueError``); ``unsupported``: a setting PD is not
    simulated with (llama.cpp, several DP ranks)."""
    if mode not in MODES:
        raise ValueError(f"disaggregation_mode must be one of {', '.join(MODES)}, not {mode!r}")
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"disaggregation_transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}"
        )
    if mode == "prefill" and backend == "fake":
        # SGLang's assert in handle_pd_disaggregation
        raise ValueError("Prefill server does not support 'fake' as the transfer backend")
    if not 0 <= bootstrap_port <= 65535:
        raise ValueError("disaggregation_bootstrap_port must be a port number (0: ephemeral)")
    get_transfer_profile(transfer_profile)
    if min(timeouts) <= 0:
        raise ValueError("bootstrap_timeout_s and waiting_timeout_s must be positive")
    if mode != "null" and unsupported:
        raise ValueError("disaggregation is simulated for the sglang engine with dp_size 1 only")


@dataclass
class PDCounters:
    """What both roles count (``sglang:num_*_failed_reqs_total``, and ``/v1/loads``' last
    transfer figures)."""

    bootstrap_failed: int = 0
    transfer_failed: int = 0
    transfers: int = 0
    last_latency_ms: float = 0.0
    last_speed_gb_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a finished prefill hands its decode side (SGLang's metadata buffer), and what
    its transfer took."""

    prompt_tokens: int
    cached_tokens: int
    output_id: int
    transfer_s: float = 0.0  # modelled seconds, from the end of the prefill
    nbytes: int = 0


TransferDone = Callable[[str, Handoff | None, str | None], None]
ABORTED = "Aborted by AbortReq."  # SGLang's failure reason for an aborted room


class _PDModel(WorkerModel):
    """What both roles share: the requests held outside the scheduler, and failing them."""

    def setup_pd(self) -> None:
        """Initialise the PD state (the dataclass ``__init__`` is the base's)."""
        self.pd = PDCounters()
        self._expected: set[str] = set()
        self._reject: dict[str, str] = {}
        self._held: dict[str, ReqState] = {}

    def expect(self, rid: str) -> None:
        """The next ``submit`` of ``rid`` is a disaggregated request: hold it."""
        self._expected.add(rid)

    def reject(self, rid: str, message: str) -> None:
        """The next ``submit`` of ``rid`` is aborted by the scheduler with a 400 (SGLang's
        answer to a disaggregated request without a bootstrap room)."""
        self._reject[rid] = message

    def forget(self, rid: str) -> None:
        """Drop an ``expect`` or ``reject`` that no ``submit`` consumed."""
        self._expected.discard(rid)
        self._reject.pop(rid, None)

    def submit(self, req: SimRequest, now: float) -> None:
        message = self._reject.pop(req.rid, None)
        if message is not None:
            r = self._take(req, now)
            if r is not None:
                del self._held[r.rid]
                self._finish(r, Finish("abort", 0, message=message, status_code=400), now)
                self.counters.aborted += 1
            return
        if req.rid in self._expected:
            self._expected.discard(req.rid)
            self._take(self._held_request(req), now)
            return
        super().submit(req, now)

    def _held_request(self, req: SimRequest) -> SimRequest:
        """What a held request is submitted as."""
        return req

    def _take(self, req: SimRequest, now: float) -> ReqState | None:
        """Submit ``req`` and pull it out of the waiting queue (None: it finished at once,
        e.g. a prompt too long for the pool)."""
        super().submit(req, now)
        r = self._by_rid.get(req.rid)
        if r is None or not self._waiting or self._waiting[-1] is not r:
            return None
        self._waiting.pop()
        self._dequeued(r)
        self._held[r.rid] = r
        return r

    def holds(self, rid: str) -> bool:
        return rid in self._held

    def fail(self, rid: str, message: str, now: float, *, bootstrap: bool) -> bool:
        """End a held request with SGLang's 500 abort; False if it is not held (any more).
        ``bootstrap``: counted as a bootstrap failure, else as a transfer failure."""
        r = self._held.pop(rid, None)
        if r is None:
            return False
        self._fail(r, message, now, bootstrap=bootstrap)
        return True

    def _fail(self, r: ReqState, message: str, now: float, *, bootstrap: bool) -> None:
        finish = Finish("abort", r.out_len, message=message, status_code=500)
        self._finish(r, finish, now)
        self.counters.aborted += 1
        if bootstrap:
            self.pd.bootstrap_failed += 1
        else:
            self.pd.transfer_failed += 1

    def abort(self, rid: str, now: float) -> None:
        r = self._held.pop(rid, None)
        if r is None:
            super().abort(rid, now)
            return
        self._finish(r, Finish("abort", r.out_len, message="Aborted"), now)
        self.counters.aborted += 1

    def abort_all(self, now: float) -> None:
        for rid in list(self._held):
            self.abort(rid, now)
        super().abort_all(now)


class PrefillWorkerModel(_PDModel):
    """SGLang's prefill role (see module docstring)."""

    @classmethod
    def build(
        cls,
        config: WorkerSettings,
        transfer: TransferProfile,
        listener: CacheListener | None = None,
        tokenizer: OutputTokenizer | None = None,
    ) -> PrefillWorkerModel:
        """The prefill model of a worker configured by ``config``, sending over
        ``transfer``."""
        model = cls.from_config(config, listener=listener, tokenizer=tokenizer)
        assert isinstance(model, cls)
        model.setup_prefill(transfer, model.profile.kv_bytes_per_token)
        return model

    def setup_prefill(self, transfer: TransferProfile, kv_bytes_per_token: int) -> None:
        self.setup_pd()
        self.link = TransferLink(transfer, kv_bytes_per_token)
        self._pd: set[str] = set()  # scheduled PD requests
        self._failure: dict[str, str] = {}  # rid → the reason its transfer will fail
        # rid → (request, transfer start, modelled time it is done)
        self._inflight: dict[str, tuple[ReqState, float, float]] = {}
        # told of every concluded transfer: (rid, the handoff or None, the failure or None)
        self.on_transfer_done: TransferDone | None = None

    @property
    def num_bootstrap(self) -> int:
        """``sglang:num_prefill_bootstrap_queue_reqs``."""
        return len(self._held)

    @property
    def num_inflight(self) -> int:
        """``sglang:num_prefill_inflight_queue_reqs``."""
        return len(self._inflight)

    def _held_request(self, req: SimRequest) -> SimRequest:
        # the prefill role computes the prompt and samples one token (SGLang sets
        # max_new_tokens to 1 in PrefillBootstrapQueue._process_req)
        return replace(req, max_new_tokens=1, eos_at=None, ignore_eos=True)

    def bootstrapped(self, rid: str, transfer_failure: str | None = None) -> bool:
        """The decode side of ``rid`` connected: schedule it. ``transfer_failure``: the
        reason its KV transfer will fail (a fault), else None. False if not held."""
        r = self._held.pop(rid, None)
        if r is None:
            return False
        self._pd.add(rid)
        if transfer_failure is not None:
            self._failure[rid] = transfer_failure
        self._enqueue(r)
        return True

    def abort(self, rid: str, now: float) -> None:
        """Abort ``rid``; a disaggregated one's room fails too (its decode side is told)."""
        pd = rid in self._pd or rid in self._held
        self._pd.discard(rid)
        self._failure.pop(rid, None)
        inflight = self._inflight.pop(rid, None)
        if inflight is None:
            super().abort(rid, now)
        else:
            r = inflight[0]
            self._release(r, insert=True)
            self._finish(r, Finish("abort", r.out_len, message="Aborted"), now)
            self.counters.aborted += 1
        if pd and self.on_transfer_done is not None:
            self.on_transfer_done(rid, None, ABORTED)

    def abort_all(self, now: float) -> None:
        for rid in list(self._inflight):
            self.abort(rid, now)
        super().abort_all(now)

    def _finish_done(self, r: ReqState, end: float, outputs: list[RequestOutput]) -> None:
        if r.rid not in self._pd:
            super()._finish_done(r, end, outputs)
            return
        # the inflight queue: the KV stays locked in the tree while it moves
        r.state = "inflight"
        self._inflight[r.rid] = (r, end, self.link.send(end, r.prompt_len))

    def step(self, now: float) -> StepResult | None:
        self._conclude_transfers(now)
        result = super().step(now)
        if result is None and self._inflight:
            wait = min(done for _, _, done in self._inflight.values()) - now
            return StepResult(now, max(wait, 0.0), "idle", [])
        return result

    def _conclude_transfers(self, now: float) -> None:
        for rid, (r, start, done) in list(self._inflight.items()):
            if done > now:
                continue
            del self._inflight[rid]
            self._pd.discard(rid)
            failure = self._failure.pop(rid, None)
            self._release(r, insert=True)
            if failure is not None:
                self._fail(r, failure, done, bootstrap=False)
                if self.on_transfer_done is not None:
                    self.on_transfer_done(rid, None, failure)
                continue
            seconds = done - start
            nbytes = r.prompt_len * self.link.kv_bytes_per_token
            self.pd.transfers += 1
            self.pd.last_latency_ms = seconds * 1e3
            self.pd.last_speed_gb_s = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            del self._by_rid[rid]
            first = r.output_ids[0] if r.output_ids else self.eos_token_id
            handoff = Handoff(r.prompt_len, r.cached_tokens or 0, first, seconds, nbytes)
            # SGLang's FINISH_LENGTH(length=0): the decode side generates the rest
            self._pending.append(self._output(r, 1, True, Finish("length", 0), done))
            self.counters.finished += 1
            self.counters.prompt_tokens += r.prompt_len
            self.counters.cached_tokens += r.cached_tokens or 0
            self.counters.cached_host_tokens += r.cached_host
            if self.on_transfer_done is not None:
                self.on_transfer_done(rid, handoff, None)


class DecodeWorkerModel(_PDModel):
    """SGLang's decode role (see module docstring)."""

    @classmethod
    def build(
        cls,
        config: WorkerSettings,
        listener: CacheListener | None = None,
        tokenizer: OutputTokenizer | None = None,
    ) -> DecodeWorkerModel:
        """The decode model of a worker configured by ``config``."""
        model = cls.from_config(config, listener=listener, tokenizer=tokenizer)
        assert isinstance(model, cls)
        model.setup_decode()
        return model

    def setup_decode(self) -> None:
        self.setup_pd()
        self._transfer: set[str] = set()  # held requests past the handshake
        self._ready: list[tuple[ReqState, Handoff]] = []  # KV arrived, waiting for slots
        self._first_pending: set[str] = set()  # prebuilt, first decode output not out yet

    @property
    def num_prealloc(self) -> int:
        """``sglang:num_decode_prealloc_queue_reqs``."""
        return len(self._held) - len(self._transfer)

    @property
    def num_transfer(self) -> int:
        """``sglang:num_decode_transfer_queue_reqs``."""
        return len(self._transfer) + len(self._ready)

    def planned_first(self, rid: str) -> int:
        """A held request's own first token (SGLang's fake transfer makes one up)."""
        r = self._held[rid]
        return r.output_ids[0] if r.output_ids else self.eos_token_id

    def bootstrapped(self, rid: str) -> bool:
        """The handshake with the prefill's bootstrap server is done."""
        if rid not in self._held:
            return False
        self._transfer.add(rid)
        return True

    def fail(self, rid: str, message: str, now: float, *, bootstrap: bool) -> bool:
        self._transfer.discard(rid)
        return super().fail(rid, message, now, bootstrap=bootstrap)

    def abort(self, rid: str, now: float) -> None:
        self._transfer.discard(rid)
        for i, (r, _) in enumerate(self._ready):
            if r.rid == rid:
                del self._ready[i]
                self._finish(r, Finish("abort", r.out_len, message="Aborted"), now)
                self.counters.aborted += 1
                return
        super().abort(rid, now)

    def abort_all(self, now: float) -> None:
        for r, _ in list(self._ready):
            self.abort(r.rid, now)
        super().abort_all(now)

    def kv_arrived(self, rid: str, handoff: Handoff) -> bool:
        """The prefill's KV for ``rid`` is here: commit it at the next step."""
        r = self._held.pop(rid, None)
        if r is None:
            return False
        self._transfer.discard(rid)
        self._ready.append((r, handoff))
        return True

    def step(self, now: float) -> StepResult | None:
        self._now = now
        self._commit_ready(now)
        return super().step(now)

    def _commit_ready(self, now: float) -> None:
        """Prebuilt requests join the running batch while KV slots can be had."""
        cache = self.cache
        while self._ready and len(self._running) < (self.max_running_requests or 0):
            r, handoff = self._ready[0]
            if not cache.can_alloc(r.prompt_len):
                break
            self._ready.pop(0)
            cache.alloc(r.prompt_len)
            r.private = r.prompt_len
            r.computed = r.prompt_len
            r.cached_tokens = handoff.cached_tokens
            r.admitted_at = now
            r.first_token_at = now
            if r.target == 0:
                self._finish_done(r, now, self._pending)
                continue
            if isinstance(r.output_ids, list):
                r.output_ids[0] = handoff.output_id
            r.out_len = 1
            if r.out_len >= r.target:
                self._finish_done(r, now, self._pending)
                continue
            r.state = "running"
            self._running.append(r)
            self._first_pending.add(r.rid)

    def _sample(self, r: ReqState, end: float, outputs: list[RequestOutput]) -> None:
        before = len(outputs)
        super()._sample(r, end, outputs)
        if r.rid in self._first_pending:
            self._first_pending.discard(r.rid)
            if len(outputs) > before:
                outputs[-1].first_token = True

    def _release(self, r: ReqState, insert: bool) -> None:
        # no radix cache on a decode server (SGLang's default): nothing is kept
        self._first_pending.discard(r.rid)
        super()._release(r, insert=False)
