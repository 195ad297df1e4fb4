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

This module is the scheduler step. The state it moves (the request table and queues, the KV
a request holds in and out of the tree, counters, snapshots) is
:class:`simulator.model.radix_state.RadixState`, which :class:`WorkerModel` extends; the
request and output types both worker models share are in :mod:`simulator.model.requests`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from simulator.model.radix_cache import TOKEN_BYTES, CacheListener, encode_tokens
from simulator.model.radix_state import RadixState, ReqState
from simulator.model.requests import (
    Finish,
    OutputTokenizer,
    RequestOutput,
    StepKind,
    StepResult,
    output_source,
)
from simulator.model.settings import WorkerSettings

DECODE_LOG_INTERVAL = 40  # SGLang --decode-log-interval: gauge refresh cadence
LOAD_SNAPSHOT_INTERVAL = 15  # SGLang --load-snapshot-publish-interval
LPM_MAX_WAITING = 128  # SGLang WAITING_QUEUE_PREFIX_MATCH_MAX


class WorkerModel(RadixState):
    """One simulated SGLang worker (see module docstring); its fields are
    :class:`RadixState`'s."""

    @classmethod
    def from_config(
        cls,
        config: WorkerSettings,
        listener: CacheListener | None = None,
        tokenizer: OutputTokenizer | None = None,
    ) -> WorkerModel:
        """The model of one worker configured by ``config`` (a
        :class:`simulator.config.SimConfig`), as the HTTP simulator builds it; an offline
        replay that builds its workers here runs the same worker as the live fleet.
        ``tokenizer``: where output tokens and EOS come from (default: pseudo-English)."""
        profile = config.resolved_profile()
        context = config.context_length or profile.context_length
        extra: dict[str, Any] = {}
        if tokenizer is not None:
            extra = {
                "output_source": output_source(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
            }
        return cls(
            profile=profile.with_overrides(context_length=context),
            capacity_tokens=config.capacity_tokens,
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            schedule_policy=config.schedule_policy,
            seed=config.seed,
            listener=listener,
            max_loras_per_batch=config.max_loras_per_batch if config.lora_enabled else None,
            hicache=config.resolved_hicache(),
            **extra,
        )

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
            wait = self._adapter_wait(now)
            if wait is not None:  # every waiting request waits for its adapter's weights
                return StepResult(now, wait, "idle", outputs)
            if outputs:
                return StepResult(now, 0.0, "idle", outputs)
            return None
        self.counters.steps += 1
        self.counters.busy_s += result.duration
        return result

    def _plan_prefill(self, now: float) -> list[tuple[ReqState, int, int]]:
        """This step's prefill work: ``[(request, new tokens, cache-hit tokens)]``."""
        profile = self.profile
        clip = profile.clip_max_new_tokens
        budget_chunk = profile.chunked_prefill_size
        budget_input = profile.max_prefill_tokens
        page = self.page_size
        cache = self.cache
        tiered = self.tiered
        assert self.max_running_requests is not None
        batch: list[tuple[ReqState, int, int]] = []
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

        loras: set[str | None] | None = None
        if self.max_loras_per_batch is not None or self._adapter_ready:
            loras = {r.adapter for r in self._running} | {r.adapter for r, _, _ in batch}
        skipped: list[ReqState] = []  # waiting for an adapter: the next ones may go
        while self._waiting and budget_chunk >= page:
            if len(self._running) + len(batch) >= self.max_running_requests:
                break
            r = self._waiting[0]
            if loras is not None:
                if not self._lora_schedulable(r, loras, now):
                    skipped.append(self._waiting.popleft())
                    continue
                loras.add(r.adapter)
            limit = r.seq_len - 1
            limit -= limit % page
            key = r.key[: limit * TOKEN_BYTES]
            matched, node = cache.match_prefix(key, r.namespace)
            host = 0 if tiered is None else tiered.host_hit(node, key, matched)
            extend = r.seq_len - matched - host
            decode_room = min(max(r.max_new - r.out_len, 0), clip)
            cache.inc_lock(node)
            room = cache.available + cache.evictable - reserved
            # a host hit needs device slots too: the room is the same, the compute less
            if extend + host + decode_room >= room or (batch and extend >= budget_input):
                cache.dec_lock(node)
                break
            if host:
                assert tiered is not None
                end = tiered.load_back(node, key, matched, host)
                cache.inc_lock(end)
                cache.dec_lock(node)
                node = end
                matched += host
                self._step_load_tokens += host
            self._dequeued(self._waiting.popleft())
            r.state = "prefill"
            r.node = node
            r.tree_len = matched
            r.computed = matched
            if r.cached_tokens is None:
                r.cached_tokens = matched
                r.cached_host = host
                self.counters.prefill_device_hit_tokens += matched - host
                self.counters.prefill_host_hit_tokens += host
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
        self._waiting.extendleft(reversed(skipped))
        return batch

    def _run_prefill(
        self, batch: list[tuple[ReqState, int, int]], now: float, outputs: list[RequestOutput]
    ) -> StepResult:
        profile = self.profile
        cache = self.cache
        new_total = 0
        pairs = 0.0
        cached_cost = 0.0  # the cached-prefix terms (0 unless the profile sets them)
        hit = 0
        for r, n, matched in batch:
            pairs += n * (r.computed + n / 2)
            cached_cost += (
                profile.prefill_per_cached_token_s * r.computed
                + profile.cached_pair_s * r.computed * r.computed / 2
            )
            new_total += n
            hit += matched
        for _, n, _ in batch:
            cache.alloc(n)  # admission checked the room; allocate before any decode
        decode_reqs: list[ReqState] = []
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
                + cached_cost
                + profile.decode_per_context_token_s * sum_ctx
                + profile.decode_overhead_s
            )
            kind: StepKind = "mixed"
        else:
            duration = (
                profile.prefill_fixed_s
                + profile.prefill_per_token_s * new_total
                + profile.attention_per_pair_s * pairs
                + cached_cost
            )
            kind = "prefill"
        if self.tiered is not None:
            duration = self._with_tier_transfers(duration)
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
            self.cache.alloc(len(decode_reqs))
            self._decode_tokens(decode_reqs, end, outputs)

        self._last_hit_rate = hit / (hit + new_total) if hit + new_total else 0.0
        self.counters.prefill_uncached_tokens += new_total
        self.counters.prefill_busy_s += duration
        self._refresh_snapshots(end, metrics=True, load=True)
        return StepResult(now, duration, kind, outputs, new_total, len(decode_reqs))

    def _run_decode(self, now: float, outputs: list[RequestOutput]) -> StepResult:
        profile = self.profile
        reqs = self._make_decode_room()
        self.cache.alloc(len(reqs))
        sum_ctx = sum(r.computed + 1 for r in reqs)
        duration = (
            max(profile.decode_floor_s, profile.decode_per_request_s * len(reqs))
            + profile.decode_per_context_token_s * sum_ctx
            + profile.decode_overhead_s
        )
        if self.tiered is not None:
            duration += self.tiered.take_stall_s()
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

    def _with_tier_transfers(self, compute_s: float) -> float:
        """A prefill step's duration with HiCache's transfers: the step's host loads (one
        merged copy) overlap its compute layer by layer, as SGLang's per-layer load events
        let it (the step takes the longer of the two), and write-back copies made while
        evicting for it stall the scheduler before it starts (added)."""
        tiered = self.tiered
        assert tiered is not None
        load_s = tiered.record_load(self._step_load_tokens)
        self._step_load_tokens = 0
        return max(compute_s, load_s) + tiered.take_stall_s()

    def _make_decode_room(self) -> list[ReqState]:
        """Ensure one KV slot per running request, retracting requests if it cannot be had."""
        cache = self.cache
        while self._running and not cache.can_alloc(len(self._running)):
            if len(self._running) == 1:
                self._abort_oom(self._running.pop())
                break
            self._retract_one()
        return list(self._running)

    def _abort_oom(self, r: ReqState) -> None:
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

    def _decode_tokens(
        self, reqs: list[ReqState], end: float, outputs: list[RequestOutput]
    ) -> None:
        """One token each for ``reqs``, whose KV slots the caller allocated."""
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

    def _sample(self, r: ReqState, end: float, outputs: list[RequestOutput]) -> None:
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

    def _finish_done(self, r: ReqState, end: float, outputs: list[RequestOutput]) -> None:
        self._release(r, insert=True)
        if r.eos and r.out_len == r.target:
            finish = Finish("stop", r.out_len, matched=self.eos_token_id)
        else:
            finish = Finish("length", r.out_len)
        first = r.first_token_at == end and r.out_len <= 1
        del self._by_rid[r.rid]
        outputs.append(self._output(r, 1 if r.target else 0, first, finish, end))
        self.counters.finished += 1
        self.counters.prompt_tokens += r.prompt_len
        self.counters.cached_tokens += r.cached_tokens or 0
        self.counters.cached_host_tokens += r.cached_host
