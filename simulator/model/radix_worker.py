"""The worker model: SGLang's scheduler loop over a radix cache, driven by an injected clock.

One :class:`WorkerModel` is one SGLang worker (one DP rank). It never sleeps and never
reads a clock: every call takes ``now`` (seconds of modelled time). The HTTP simulator
drives it with the event loop's clock times a speed factor; the offline replay drives the
very same object with a virtual clock. The driver contract:

    result = model.step(now)        # plan and execute one batch step starting at ``now``
    if result is None: wait for submit()/abort()   # idle
    else: deliver result.outputs at now + result.duration, then step again

What a step does follows SGLang's ``Scheduler.get_next_batch_to_run`` (SGLANG_API.md §5):

* **Prefill first.** If waiting requests can be admitted, the step is a prefill batch:
  the in-progress chunked request first, then waiting requests in queue order (FCFS, or
  LPM: longest cached prefix first, falling back to FCFS above 128 waiting), each
  admitted only if its uncached prompt plus its clipped ``max_new_tokens`` fits in
  ``free + evictable - reserved decode tokens`` and ``max_running_requests`` allows. At
  most ``chunked_prefill_size`` new tokens per step; the request that does not fit is cut
  at a page boundary and continues next step (chunked prefill).
* **Admission** matches the prompt truncated to ``prompt_len - 1`` and to a page:
  ``cached_tokens`` is that match, fixed at the first admission; the matched path is locked.
* **After every prefill chunk** the computed, page-aligned prefix is inserted into the tree
  (other requests hit it from then on). A request whose prompt is complete samples its
  first token at the end of the step and joins the running batch.
* **Otherwise a decode step**: every running request gets one token, one KV slot each
  (evicting on demand; if even eviction cannot make room, the newest, shortest-output
  requests are retracted to the waiting queue, as SGLang's ``retract_decode``).
* **On finish** (length, EOS or abort) prompt + committed output (all but the last sampled
  token) is inserted, page-aligned, and the lock released: the whole path is evictable.

Step durations come from :class:`simulator.model.profiles.Profile` (PERFORMANCE.md §3).
Gauges for ``/metrics`` are refreshed after every prefill, every 40 decode steps and when
idle; the ``/v1/loads`` snapshot after every prefill, every 15 decode steps and when idle,
as SGLang does, so both lag like the real ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from simulator.config import SimConfig
from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile
from simulator.model.radix_cache import (
    TOKEN_BYTES,
    CacheListener,
    RadixCache,
    TreeNode,
    encode_tokens,
)
from simulator.model.tokenizer import default_tokenizer

FinishKind = Literal["stop", "length", "abort"]
StepKind = Literal["prefill", "decode", "mixed", "idle"]

DECODE_LOG_INTERVAL = 40  # SGLang --decode-log-interval: gauge refresh cadence
LOAD_SNAPSHOT_INTERVAL = 15  # SGLang --load-snapshot-publish-interval
LPM_MAX_WAITING = 128  # SGLang WAITING_QUEUE_PREFIX_MATCH_MAX


@dataclass(slots=True)
class SimRequest:
    """A generation request as the scheduler sees it (already tokenized)."""

    rid: str
    prompt_ids: Sequence[int] | bytes  # token ids, or a key from radix_cache.encode_tokens
    max_new_tokens: int = 128
    ignore_eos: bool = False
    # The "model" emits EOS as its eos_at-th token (finish "stop") unless ignore_eos or the
    # length limit comes first. None: no natural stop, the request runs to max_new_tokens.
    eos_at: int | None = None
    namespace: str = ""  # cache_salt / extra_key / LoRA: namespaces never share prefixes
    stream: bool = True  # report every new token (else only the first token and the finish)
    output_ids: Sequence[int] | None = None  # planned output; default: pseudo-text


@dataclass(frozen=True, slots=True)
class Finish:
    kind: FinishKind
    length: int = 0  # completion tokens at finish
    matched: int | None = None  # EOS token id for "stop"
    message: str | None = None  # for "abort"
    status_code: int | None = None


@dataclass(slots=True)
class RequestOutput:
    """What became visible for one request at the end of a step."""

    rid: str
    new_tokens: int
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    first_token: bool
    finish: Finish | None
    arrival: float
    time: float  # modelled time at which this output is visible
    output_ids: Sequence[int] = ()  # the full planned output; the first completion_tokens are real


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    kind: StepKind
    outputs: list[RequestOutput]
    prefill_tokens: int = 0  # new (uncached) tokens computed this step
    decode_batch: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


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


class _Req:
    """Scheduler-side state of one request."""

    __slots__ = (
        "admitted_at",
        "arrival",
        "cached_tokens",
        "computed",
        "eos",
        "first_token_at",
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
        self.node: TreeNode | None = None  # locked tree path
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


OutputSource = Callable[[bytes, int, int], list[int]]


def pseudo_text_output(prompt_key: bytes, seed: int, n: int) -> list[int]:
    """Deterministic pseudo-English output: a slice of the tokenizer's ring chosen by the
    prompt's hash (same prompt and seed → same text, like temperature 0)."""
    return default_tokenizer().pseudo_output_ids(xxhash.xxh64_intdigest(prompt_key, seed), n)


def planned_output(
    req: SimRequest, key: bytes, limit: int, seed: int, source: OutputSource
) -> tuple[list[int], bool]:
    """The tokens ``req`` will generate with at most ``limit`` of them, and whether the last
    is EOS (``eos_at`` within the limit and not ``ignore_eos``)."""
    length = limit
    eos = not req.ignore_eos and req.eos_at is not None and req.eos_at <= limit
    if eos:
        assert req.eos_at is not None
        length = req.eos_at
    output = (
        list(req.output_ids[:length]) if req.output_ids is not None else source(key, seed, length)
    )
    if eos and output:
        output[-1] = default_tokenizer().eos_token_id
    return output, eos


@dataclass
class _Counters:
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


@dataclass
class _Window:
    time: float = 0.0
    generated: int = 0
    busy_s: float = 0.0


@dataclass
class WorkerModel:
    """One simulated SGLang worker (see module docstring)."""

    profile: Profile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    capacity_tokens: int | None = None  # default: the profile's
    page_size: int = 1
    max_running_requests: int | None = None  # default: SGLang's formula
    schedule_policy: str = "fcfs"
    seed: int = 0
    output_source: OutputSource = pseudo_text_output
    listener: CacheListener | None = None

    @classmethod
    def from_config(cls, config: SimConfig, listener: CacheListener | None = None) -> WorkerModel:
        """The model of one worker configured by ``config``, exactly as the HTTP simulator
        builds it (the offline replay uses this too, so both run the same worker)."""
        profile = config.resolved_profile()
        context = config.context_length or profile.context_length
        return cls(
            profile=profile.with_overrides(context_length=context),
            capacity_tokens=config.capacity_tokens,
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            schedule_policy=config.schedule_policy,
            seed=config.seed,
            listener=listener,
        )

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError("schedule_policy must be 'fcfs' or 'lpm'")
        if self.profile.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        capacity = self.capacity_tokens or self.profile.capacity_tokens
        capacity -= capacity % self.page_size
        self.capacity_tokens = capacity
        self.cache = RadixCache(capacity, self.page_size, self.listener)
        if self.max_running_requests is None:
            by_context = capacity / self.profile.context_length * 512
            self.max_running_requests = int(min(max(by_context, 2048), 4096, max(capacity // 2, 1)))
        self._waiting: deque[_Req] = deque()
        self._waiting_tokens = 0  # Σ seq_len over the waiting queue
        self._waiting_retracted = 0
        self._running: list[_Req] = []
        self._chunked: _Req | None = None
        self._by_rid: dict[str, _Req] = {}
        self._pending: list[RequestOutput] = []
        self._new_token_ratio = self.profile.init_new_token_ratio
        self._ratio_decay = (
            self.profile.init_new_token_ratio - self.profile.min_new_token_ratio
        ) / max(self.profile.new_token_ratio_decay_steps, 1)
        self._last_hit_rate = 0.0
        self._decode_since_metrics = 0
        self._decode_since_load = 0
        self.counters = _Counters()
        self._window = _Window()
        self._now = 0.0
        self.metrics_snapshot = self.stats(0.0)
        self.load_snapshot = self.metrics_snapshot

    # ------------------------------------------------------------------ requests
    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request (it is admitted by a later :meth:`step`)."""
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
        # SGLang's scheduler: a request must fit the pool; max_new_tokens is clipped to it
        max_req_len = min(self.profile.context_length - 1, self.cache.capacity - 1)
        if prompt_len >= max_req_len:
            raise ValueError(
                f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                f"({max_req_len} tokens)."
            )
        limit = min(max(req.max_new_tokens, 0), max_req_len - prompt_len - 1)
        output, eos = planned_output(req, key, limit, self.seed, self.output_source)
        r = _Req(req, key, output, now, limit, eos)
        self._by_rid[r.rid] = r
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

    def _enqueue(self, r: _Req, front: bool = False) -> None:
        if front:
            self._waiting.appendleft(r)
        else:
            self._waiting.append(r)
        self._waiting_tokens += r.seq_len
        self._waiting_retracted += 1 if r.retracted else 0

    def _dequeued(self, r: _Req) -> None:
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

    # ------------------------------------------------------------------ the step
    def step(self, now: float) -> StepResult | None:
        """Plan and execute one batch step starting at ``now`` (see module docstring)."""
        self._now = now
        outputs = self._pending
        self._pending = []
        batch = self._plan_prefill(now)
        if batch:
            result = self._run_prefill(batch, now, outputs)
        elif self._running:
            result = self._run_decode(now, outputs)
        else:
            self._refresh_snapshots(now, metrics=True, load=True)
            if outputs:
                return StepResult(now, 0.0, "idle", outputs)
            return None
        self.counters.steps += 1
        self.counters.busy_s += result.duration
        return result

    def _plan_prefill(self, now: float) -> list[tuple[_Req, int, int]]:
        """This step's prefill work: ``[(request, new tokens, cache-hit tokens)]``."""
        profile = self.profile
        clip = profile.clip_max_new_tokens
        budget_chunk = profile.chunked_prefill_size
        budget_input = profile.max_prefill_tokens
        page = self.page_size
        cache = self.cache
        assert self.max_running_requests is not None
        batch: list[tuple[_Req, int, int]] = []
        reserved = sum(min(max(r.max_new - r.out_len, 0), clip) for r in self._running)
        reserved = int(reserved * self._new_token_ratio)

        chunked = self._chunked
        if chunked is not None:
            remaining = chunked.seq_len - chunked.computed
            n = min(remaining, budget_chunk)
            if n < remaining:
                n -= n % page
            while not cache.can_alloc(n) and self._running:
                self._retract_one()
            if not cache.can_alloc(n):
                self._chunked = None
                self._abort_oom(chunked)
                return batch
            batch.append((chunked, n, 0))
            budget_chunk -= n
            budget_input -= n
            reserved += remaining + min(chunked.max_new, clip)
            if n < remaining:
                return batch

        if not self._waiting:
            return batch
        if self.schedule_policy == "lpm" and 1 < len(self._waiting) <= LPM_MAX_WAITING:
            self._waiting = deque(
                sorted(self._waiting, key=lambda r: -cache.peek_prefix(r.key, r.namespace))
            )

        while self._waiting and budget_chunk >= page:
            if len(self._running) + len(batch) >= self.max_running_requests:
                break
            r = self._waiting[0]
            limit = r.seq_len - 1
            limit -= limit % page
            matched, node = cache.match_prefix(r.key[: limit * TOKEN_BYTES], r.namespace)
            extend = r.seq_len - matched
            decode_room = min(max(r.max_new - r.out_len, 0), clip)
            cache.inc_lock(node)
            room = cache.available + cache.evictable - reserved
            if extend + decode_room >= room or (batch and extend >= budget_input):
                cache.dec_lock(node)
                break
            self._dequeued(self._waiting.popleft())
            r.state = "prefill"
            r.node = node
            r.tree_len = matched
            r.computed = matched
            if r.cached_tokens is None:
                r.cached_tokens = matched
            r.admitted_at = now
            n = extend
            if n > budget_chunk:
                n = budget_chunk - budget_chunk % page
                self._chunked = r
            batch.append((r, n, matched))
            budget_chunk -= n
            budget_input -= n
            reserved += extend + decode_room
            if self._chunked is r:
                break
        return batch

    def _run_prefill(
        self, batch: list[tuple[_Req, int, int]], now: float, outputs: list[RequestOutput]
    ) -> StepResult:
        profile = self.profile
        cache = self.cache
        new_total = 0
        pairs = 0.0
        hit = 0
        for r, n, matched in batch:
            pairs += n * (r.computed + n / 2)
            new_total += n
            hit += matched
        for _, n, _ in batch:
            cache.alloc(n)  # admission checked the room; allocate before any decode
        decode_reqs: list[_Req] = []
        if profile.mixed_chunk and self._running:
            decode_reqs = self._make_decode_room()
        if decode_reqs:
            sum_ctx = sum(r.computed + 1 for r in decode_reqs)
            duration = (
                max(
                    profile.decode_floor_s,
                    profile.decode_per_request_s * (new_total + len(decode_reqs)),
                )
                + profile.attention_per_pair_s * pairs
                + profile.decode_per_context_token_s * sum_ctx
                + profile.decode_overhead_s
            )
            kind: StepKind = "mixed"
        else:
            duration = (
                profile.prefill_fixed_s
                + profile.prefill_per_token_s * new_total
                + profile.attention_per_pair_s * pairs
            )
            kind = "prefill"
        end = now + duration

        for r, n, _ in batch:
            r.private += n
            r.computed += n
            self._checkpoint(r)
            if r.computed < r.seq_len:
                continue  # chunked: continues next step
            if r is self._chunked:
                self._chunked = None
            self._sample(r, end, outputs)
            if r.out_len >= r.target:
                self._finish_done(r, end, outputs)
            else:
                r.state = "running"
                self._running.append(r)
        if decode_reqs:
            self._decode_tokens(decode_reqs, end, outputs)

        self._last_hit_rate = hit / (hit + new_total) if hit + new_total else 0.0
        self.counters.prefill_uncached_tokens += new_total
        self.counters.prefill_busy_s += duration
        self._refresh_snapshots(end, metrics=True, load=True)
        return StepResult(now, duration, kind, outputs, new_total, len(decode_reqs))

    def _run_decode(self, now: float, outputs: list[RequestOutput]) -> StepResult:
        profile = self.profile
        reqs = self._make_decode_room()
        sum_ctx = sum(r.computed + 1 for r in reqs)
        duration = (
            max(profile.decode_floor_s, profile.decode_per_request_s * len(reqs))
            + profile.decode_per_context_token_s * sum_ctx
            + profile.decode_overhead_s
        )
        end = now + duration
        self._decode_tokens(reqs, end, outputs)
        self._new_token_ratio = max(
            profile.min_new_token_ratio, self._new_token_ratio - self._ratio_decay
        )
        self.counters.decode_steps += 1
        self._decode_since_metrics += 1
        self._decode_since_load += 1
        self._refresh_snapshots(
            end,
            metrics=self._decode_since_metrics >= DECODE_LOG_INTERVAL,
            load=self._decode_since_load >= LOAD_SNAPSHOT_INTERVAL,
        )
        return StepResult(now, duration, "decode", outputs, 0, len(reqs))

    def _make_decode_room(self) -> list[_Req]:
        """Ensure one KV slot per running request, retracting requests if it cannot be had."""
        cache = self.cache
        while self._running and not cache.can_alloc(len(self._running)):
            if len(self._running) == 1:
                self._abort_oom(self._running.pop())
                break
            self._retract_one()
        return list(self._running)

    def _abort_oom(self, r: _Req) -> None:
        """A request that cannot fit even alone: SGLang aborts it with a 503."""
        self._release(r, insert=True)
        finish = Finish("abort", r.out_len, message="KV cache pool is full", status_code=503)
        self._finish(r, finish, self._now)
        self.counters.aborted += 1

    def _retract_one(self) -> None:
        # SGLang retracts the request with the fewest output tokens, then the longest prompt
        victim = min(self._running, key=lambda r: (r.out_len, -r.prompt_len))
        self._running.remove(victim)
        self._release(victim, insert=False)
        victim.state = "waiting"
        victim.key = victim.prompt_key + encode_tokens(list(victim.output_ids[: victim.out_len]))
        victim.retracted += 1
        self._enqueue(victim, front=True)
        self._new_token_ratio = self.profile.init_new_token_ratio
        self.counters.retractions += 1

    def _decode_tokens(self, reqs: list[_Req], end: float, outputs: list[RequestOutput]) -> None:
        self.cache.alloc(len(reqs))
        done = 0
        for r in reqs:
            r.private += 1
            r.computed += 1
            self._sample(r, end, outputs)
            if r.out_len >= r.target:
                r.state = "done"
                self._finish_done(r, end, outputs)
                done += 1
        if done:
            self._running = [r for r in self._running if r.state == "running"]

    def _sample(self, r: _Req, end: float, outputs: list[RequestOutput]) -> None:
        """One new token for ``r`` becomes visible at ``end``."""
        first = r.out_len == 0
        if r.target > 0:
            r.out_len += 1
            self.counters.generation_tokens += 1
            self._window.generated += 1
        if first:
            r.first_token_at = end
        if (first or r.stream) and r.out_len < r.target:
            outputs.append(self._output(r, 1 if r.target else 0, first, None, end))

    def _finish_done(self, r: _Req, end: float, outputs: list[RequestOutput]) -> None:
        self._release(r, insert=True)
        if r.eos and r.out_len == r.target:
            finish = Finish("stop", r.out_len, matched=default_tokenizer().eos_token_id)
        else:
            finish = Finish("length", r.out_len)
        first = r.first_token_at == end and r.out_len <= 1
        del self._by_rid[r.rid]
        outputs.append(self._output(r, 1 if r.target else 0, first, finish, end))
        self.counters.finished += 1
        self.counters.prompt_tokens += r.prompt_len
        self.counters.cached_tokens += r.cached_tokens or 0

    def _finish(self, r: _Req, finish: Finish, now: float) -> None:
        del self._by_rid[r.rid]
        self._pending.append(self._output(r, 0, False, finish, now))

    def _output(
        self, r: _Req, new: int, first: bool, finish: Finish | None, when: float
    ) -> RequestOutput:
        return RequestOutput(
            rid=r.rid,
            new_tokens=new,
            completion_tokens=r.out_len,
            prompt_tokens=r.prompt_len,
            cached_tokens=r.cached_tokens or 0,
            first_token=first,
            finish=finish,
            arrival=r.arrival,
            time=when,
            output_ids=r.output_ids,
        )

    # ------------------------------------------------------------------ KV bookkeeping
    def _checkpoint(self, r: _Req) -> None:
        """Insert the computed, page-aligned prefix; move the lock to its end."""
        aligned = r.computed - r.computed % self.page_size
        if aligned <= r.tree_len:
            return
        cache = self.cache
        existing, node = cache.insert_path(
            r.committed_key()[: aligned * TOKEN_BYTES], r.namespace, allocated=True
        )
        cache.free(existing - r.tree_len)  # our copies of tokens someone else inserted first
        r.private -= aligned - r.tree_len
        cache.inc_lock(node)
        if r.node is not None:
            cache.dec_lock(r.node)
        r.node = node
        r.tree_len = aligned

    def _release(self, r: _Req, insert: bool) -> None:
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
