"""The state one SGLang worker model keeps: its requests, queues, KV bookkeeping, statistics.

:class:`RadixState` is the half of :class:`simulator.model.radix_worker.WorkerModel` that
does not decide anything: the request table and the waiting queue (submit, abort), the KV
slots a request holds in and out of the radix tree (checkpoint, release), the counters and
the ``/metrics`` and ``/v1/loads`` snapshots. The scheduler step that moves this state, and
the contract both halves keep, are in :mod:`simulator.model.radix_worker`. Like the step,
nothing here sleeps or reads a clock: every call that needs the time takes ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from simulator.model.hicache import HiCacheSettings
from simulator.model.hiradix_cache import HiRadixCache
from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile
from simulator.model.radix_cache import (
    TOKEN_BYTES,
    CacheListener,
    RadixCache,
    TreeNode,
    encode_tokens,
)
from simulator.model.requests import (
    DEFAULT_EOS,
    Finish,
    OutputSource,
    RequestOutput,
    SimRequest,
    planned_output,
    pseudo_text_output,
)


@dataclass(frozen=True, slots=True)
class ModelStats:
    """A snapshot of scheduler state, in SGLang's vocabulary."""

    time: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_prefilling_reqs: int  # the chunked request in progress (not in SGLang's running count)
    num_used_tokens: int  # capacity - available - evictable
    kv_available_tokens: int
    kv_evictable_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float  # of the last prefill batch
    gen_throughput: float  # tokens/s since the previous snapshot
    utilization: float  # busy fraction since the previous snapshot
    num_waiting_tokens: int  # Σ seqlen over the waiting queue
    num_waiting_uncached_tokens: int
    num_active_tokens: int  # Σ context length of running requests
    decode_sum_seq_lens: int
    num_retracted_reqs: int  # retracted requests waiting to be re-admitted
    new_token_ratio: float
    host_used_tokens: int = 0  # HiCache's host tier (0 without)
    host_total_tokens: int = 0


class ReqState:
    """Scheduler-side state of one request."""

    __slots__ = (
        "adapter",
        "admitted_at",
        "arrival",
        "cached_host",
        "cached_tokens",
        "computed",
        "eos",
        "first_token_at",
        "inserted",
        "key",
        "max_new",
        "namespace",
        "node",
        "out_len",
        "output_ids",
        "private",
        "prompt_key",
        "prompt_len",
        "retracted",
        "rid",
        "state",
        "stream",
        "target",
        "tree_len",
    )

    def __init__(
        self,
        req: SimRequest,
        prompt_key: bytes,
        output_ids: list[int],
        now: float,
        max_new: int,
        eos: bool,
    ) -> None:
        self.rid = req.rid
        self.prompt_key = prompt_key
        self.key = prompt_key  # what prefill computes: the prompt, or prompt+output if retracted
        self.prompt_len = len(prompt_key) // TOKEN_BYTES
        self.namespace = req.namespace
        self.adapter = req.adapter
        self.stream = req.stream
        self.output_ids = output_ids
        self.target = len(output_ids)  # tokens it will generate (EOS included)
        self.max_new = max_new  # max_new_tokens after the scheduler's clip
        self.eos = eos
        self.state = "waiting"  # → "prefill" (admitted) → "running" (decoding) → "done"
        self.arrival = now
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.cached_tokens: int | None = None
        self.cached_host = 0  # of cached_tokens, loaded from the host tier (HiCache)
        self.node: TreeNode | None = None  # locked tree path
        self.inserted = 0  # tokens of key this request inserted (SGLang's cache_inserted_len)
        self.tree_len = 0  # tokens of key held in the tree (the locked path)
        self.computed = 0  # tokens of key with KV (tree + private)
        self.private = 0  # KV slots held outside the tree
        self.out_len = 0
        self.retracted = 0

    @property
    def seq_len(self) -> int:
        return len(self.key) // TOKEN_BYTES

    def committed_key(self) -> bytes:
        """The first ``computed`` tokens of prompt + output: what has KV."""
        extra = self.computed - self.prompt_len
        if extra <= 0:
            return self.prompt_key[: self.computed * TOKEN_BYTES]
        return self.prompt_key + encode_tokens(list(self.output_ids[:extra]))


@dataclass
class Counters:
    """Running totals since start (what ``/_sim/stats`` and ``/v1/loads`` report)."""

    prompt_tokens: int = 0  # of finished requests
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    retractions: int = 0
    prefill_uncached_tokens: int = 0
    prefill_busy_s: float = 0.0
    busy_s: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    requests_submitted: int = 0
    # HiCache: cached tokens of finished requests loaded from the host tier; per prefill
    # step, hits by tier and computed tokens (sglang:prefill_effective_tokens_total)
    cached_host_tokens: int = 0
    prefill_device_hit_tokens: int = 0
    prefill_host_hit_tokens: int = 0


@dataclass
class _Window:
    time: float = 0.0
    generated: int = 0
    busy_s: float = 0.0


@dataclass
class RadixState:
    """Configuration and state of one simulated SGLang worker (see module docstring)."""

    profile: Profile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    capacity_tokens: int | None = None  # default: the profile's
    page_size: int = 1
    max_running_requests: int | None = None  # default: SGLang's formula
    schedule_policy: str = "fcfs"
    seed: int = 0
    output_source: OutputSource = pseudo_text_output
    eos_token_id: int = DEFAULT_EOS
    listener: CacheListener | None = None
    # SGLang's --max-loras-per-batch (None: LoRA off): distinct adapters in one running
    # batch, the base model (no adapter) counting as one
    max_loras_per_batch: int | None = None
    # SGLang's --enable-hierarchical-cache, resolved (None: off): a host tier under the
    # radix cache (simulator.model.hiradix_cache)
    hicache: HiCacheSettings | None = None

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError("schedule_policy must be 'fcfs' or 'lpm'")
        if self.profile.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        capacity = self.capacity_tokens or self.profile.capacity_tokens
        capacity -= capacity % self.page_size
        self.capacity_tokens = capacity
        self.tiered: HiRadixCache | None = None
        if self.hicache is None:
            self.cache = RadixCache(capacity, self.page_size, self.listener)
        else:
            self.tiered = HiRadixCache(capacity, self.page_size, self.listener, self.hicache)
            self.cache = self.tiered
        self._step_load_tokens = 0  # host tokens loaded for this step's admissions
        if self.max_running_requests is None:
            by_context = capacity / self.profile.context_length * 512
            self.max_running_requests = int(min(max(by_context, 2048), 4096, max(capacity // 2, 1)))
        self._waiting: deque[ReqState] = deque()
        self._waiting_tokens = 0  # Σ seq_len over the waiting queue
        self._waiting_retracted = 0
        self._running: list[ReqState] = []
        self._chunked: ReqState | None = None
        self._by_rid: dict[str, ReqState] = {}
        # adapter → modelled time its weights are in place (a load or an implicit reload)
        self._adapter_ready: dict[str, float] = {}
        self._pending: list[RequestOutput] = []
        self._new_token_ratio = self.profile.init_new_token_ratio
        self._ratio_decay = (
            self.profile.init_new_token_ratio - self.profile.min_new_token_ratio
        ) / max(self.profile.new_token_ratio_decay_steps, 1)
        self._last_hit_rate = 0.0
        self._decode_since_metrics = 0
        self._decode_since_load = 0
        self.counters = Counters()
        self._window = _Window()
        self._now = 0.0
        self.metrics_snapshot = self.stats(0.0)
        self.load_snapshot = self.metrics_snapshot

    @property
    def max_req_input_len(self) -> int:
        """The longest prompt the scheduler takes is one token shorter than this (0.5.23:
        ``min(context_length - 1, max_total_num_tokens - 1) - 5``)."""
        return min(self.profile.context_length - 1, self.cache.capacity - 1) - 5

    # ------------------------------------------------------------------ requests
    # ------------------------------------------------------------------ LoRA adapters
    def adapter_loading(self, name: str, ready_at: float) -> None:
        """``name``'s weights are being loaded until ``ready_at`` (modelled time): its
        requests wait in the queue until then, the others are scheduled meanwhile (SGLang
        with ``--enable-lora-overlap-loading``)."""
        self._adapter_ready[name] = ready_at

    def adapter_unloaded(self, name: str) -> None:
        self._adapter_ready.pop(name, None)

    def _adapter_wait(self, now: float) -> float | None:
        """Modelled seconds until a waiting request's adapter is in place, when every
        waiting request waits for one (else None)."""
        ready = [self._adapter_ready.get(r.adapter, 0.0) for r in self._waiting if r.adapter]
        if not ready or len(ready) < len(self._waiting) or min(ready) <= now:
            return None
        return min(ready) - now

    def _lora_schedulable(self, r: ReqState, running: set[str | None], now: float) -> bool:
        """SGLang's ``can_schedule_lora_req``: the adapter is in place, and adding it keeps
        at most ``max_loras_per_batch`` distinct adapters (the base model is one)."""
        if r.adapter is not None and self._adapter_ready.get(r.adapter, 0.0) > now:
            return False
        limit = self.max_loras_per_batch
        return limit is None or r.adapter in running or len(running) < limit

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request (a later ``step`` admits it)."""
        if req.rid in self._by_rid:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        prompt = req.prompt_ids
        if isinstance(prompt, bytes):
            key = prompt
        else:
            key = encode_tokens(prompt if isinstance(prompt, list) else list(prompt))
        prompt_len = len(key) // TOKEN_BYTES
        if prompt_len == 0:
            raise ValueError("The prompt is empty.")
        # SGLang's scheduler: a request must fit the pool; max_new_tokens is clipped to it.
        # A longer prompt is aborted by the scheduler with a 400 (validate_input_length),
        # not refused before queueing: a stream gets its error as an event.
        max_req_len = min(self.profile.context_length - 1, self.cache.capacity - 1)
        max_input = self.max_req_input_len
        too_long = prompt_len >= max_input
        limit = 0 if too_long else min(max(req.max_new_tokens, 0), max_req_len - prompt_len - 1)
        output, eos = planned_output(
            req, key, limit, self.seed, self.output_source, self.eos_token_id
        )
        r = ReqState(req, key, output, now, limit, eos)
        self._by_rid[r.rid] = r
        if too_long:
            message = (
                f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                f"({max_input} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
            abort = Finish("abort", 0, message=message, status_code=400, err_type="BadRequestError")
            self._finish(r, abort, now)
            self.counters.requests_submitted += 1
            return
        self._enqueue(r)
        self.counters.requests_submitted += 1

    def abort(self, rid: str, now: float) -> None:
        """Abort a waiting or running request; its abort output comes with the next step."""
        r = self._by_rid.get(rid)
        if r is None:
            return
        if r is self._chunked:
            self._chunked = None
            self._release(r, insert=True)
        elif r.state == "running":
            self._running.remove(r)
            self._release(r, insert=True)
        else:
            self._waiting.remove(r)
            self._dequeued(r)
        self._finish(r, Finish("abort", r.out_len, message="Aborted"), now)
        self.counters.aborted += 1

    def _enqueue(self, r: ReqState, front: bool = False) -> None:
        if front:
            self._waiting.appendleft(r)
        else:
            self._waiting.append(r)
        self._waiting_tokens += r.seq_len
        self._waiting_retracted += 1 if r.retracted else 0

    def _dequeued(self, r: ReqState) -> None:
        self._waiting_tokens -= r.seq_len
        self._waiting_retracted -= 1 if r.retracted else 0

    def abort_all(self, now: float) -> None:
        for rid in list(self._by_rid):
            self.abort(rid, now)

    def flush_cache(self) -> bool:
        """Drop the radix tree; refused (False) while requests run or wait, like SGLang."""
        if self._by_rid:
            return False
        self.cache.reset()
        return True

    def _finish(self, r: ReqState, finish: Finish, now: float) -> None:
        del self._by_rid[r.rid]
        self._pending.append(self._output(r, 0, False, finish, now))

    def _output(
        self, r: ReqState, new: int, first: bool, finish: Finish | None, when: float
    ) -> RequestOutput:
        return RequestOutput(
            rid=r.rid,
            new_tokens=new,
            completion_tokens=r.out_len,
            prompt_tokens=r.prompt_len,
            cached_tokens=r.cached_tokens or 0,
            cached_host=r.cached_host,
            first_token=first,
            finish=finish,
            arrival=r.arrival,
            time=when,
            output_ids=r.output_ids,
        )

    # ------------------------------------------------------------------ KV bookkeeping
    def _checkpoint(self, r: ReqState) -> None:
        """Insert the computed, page-aligned prefix; move the lock to its end."""
        aligned = r.computed - r.computed % self.page_size
        if aligned <= r.tree_len:
            return
        cache = self.cache
        existing, node = cache.insert_path(
            r.committed_key()[: aligned * TOKEN_BYTES],
            r.namespace,
            allocated=True,
            inserted_len=r.inserted,
        )
        r.inserted = aligned
        cache.free(existing - r.tree_len)  # our copies of tokens someone else inserted first
        r.private -= aligned - r.tree_len
        cache.inc_lock(node)
        if r.node is not None:
            cache.dec_lock(r.node)
        r.node = node
        r.tree_len = aligned

    def _release(self, r: ReqState, insert: bool) -> None:
        """Free the request's KV: insert the committed part first if ``insert``."""
        if insert and r.computed > r.tree_len:
            self._checkpoint(r)
        if r.private:
            self.cache.free(r.private)
            r.private = 0
        if r.node is not None:
            self.cache.dec_lock(r.node)
            r.node = None
        r.tree_len = 0
        r.computed = 0
        r.inserted = 0

    # ------------------------------------------------------------------ stats
    @property
    def now(self) -> float:
        """The start time of the last step."""
        return self._now

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_prefilling(self) -> int:
        return 1 if self._chunked is not None else 0

    @property
    def num_in_system(self) -> int:
        return len(self._by_rid)

    @property
    def idle(self) -> bool:
        return not self._by_rid and not self._pending

    def has_request(self, rid: str) -> bool:
        return rid in self._by_rid

    @property
    def token_usage(self) -> float:
        """KV held by live requests over capacity (excludes the idle, evictable cache)."""
        return self.cache.used / self.cache.capacity

    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens of finished requests."""
        return self.counters.prompt_tokens

    @property
    def cached_tokens_total(self) -> int:
        """Cached prompt tokens of finished requests."""
        return self.counters.cached_tokens

    def stats(self, now: float) -> ModelStats:
        """Live figures (``/metrics`` and ``/v1/loads`` serve the lagged snapshots)."""
        cache = self.cache
        used = cache.used
        waiting_tokens = self._waiting_tokens
        uncached = int(waiting_tokens * (1.0 - self._last_hit_rate))
        if self._chunked is not None:
            uncached += self._chunked.seq_len - self._chunked.computed
        active = sum(r.computed + 1 for r in self._running)
        window = self._window
        elapsed = now - window.time
        busy = self.counters.busy_s - window.busy_s
        return ModelStats(
            time=now,
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            num_prefilling_reqs=self.num_prefilling,
            num_used_tokens=used,
            kv_available_tokens=cache.available,
            kv_evictable_tokens=cache.evictable,
            max_total_num_tokens=cache.capacity,
            token_usage=used / cache.capacity,
            cache_hit_rate=self._last_hit_rate,
            gen_throughput=window.generated / elapsed if elapsed > 0 else 0.0,
            utilization=min(busy / elapsed, 1.0) if elapsed > 0 else 0.0,
            num_waiting_tokens=waiting_tokens,
            num_waiting_uncached_tokens=uncached,
            num_active_tokens=active,
            decode_sum_seq_lens=active,
            num_retracted_reqs=self._waiting_retracted,
            new_token_ratio=self._new_token_ratio,
            host_used_tokens=self.tiered.host_used if self.tiered is not None else 0,
            host_total_tokens=self.tiered.host_capacity if self.tiered is not None else 0,
        )

    def _refresh_snapshots(self, now: float, *, metrics: bool, load: bool) -> None:
        if not (metrics or load):
            return
        snap = self.stats(now)
        if metrics:
            self.metrics_snapshot = snap
            self._decode_since_metrics = 0
            self._window = _Window(now, 0, self.counters.busy_s)
        if load:
            self.load_snapshot = snap
            self._decode_since_load = 0
