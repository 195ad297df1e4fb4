"""The llama.cpp worker model: ``n_parallel`` slots, one KV sequence each, one compute thread.

:class:`SlotWorkerModel` is the llama.cpp counterpart of
:class:`simulator.model.radix_worker.WorkerModel` (SGLang's radix cache) under the same
driver contract: it never sleeps and never reads a clock,
every call takes ``now`` (modelled seconds), and

    result = model.step(now)        # one batch starting at ``now``
    if result is None: wait for submit()/abort()   # idle
    else: deliver result.outputs at result.end, then step again

so :class:`simulator.model.driver.ModelDriver` runs it on the event loop and an offline replay can
run it on a virtual clock. It models llama.cpp's server as run by the project's fleet
(``cache_ram_mib=0``, ``kv_unified=False``; docs/REAL_ENGINE.md):

* **Slots.** ``slots`` slots, each holding exactly one token sequence: the last prompt it
  ran plus the tokens generated for it (all but the last sampled token, which never got
  KV). Slots share no KV; nothing is kept anywhere else.
* **Slot choice** (at the start of a step, for each waiting request in FIFO order while an
  idle slot exists): among the idle slots holding something, the one whose content shares
  the longest common prefix with the prompt, if that prefix is more than
  ``slot_prompt_similarity`` (0.1) of the prompt; else the least recently used idle slot
  (never-used slots first, then by the time they were released; ties: lowest id). The
  request's cached tokens are that common prefix, at most ``prompt length - 1`` (one token
  is always computed); the rest of the slot's content is dropped. A request that finds no
  idle slot waits (``requests_deferred``).
* **One batch per step** (one ``llama_decode`` call on one thread): every generating slot
  contributes one token, then the slots still processing their prompt, in slot order, add
  prompt tokens while the batch has room (``n_batch``, 2,048 by default, counting the decode
  tokens). A slot whose prompt completes samples its first token at the end of the step;
  a decoding slot samples its next token.
* **Step cost**, with the profile's formulas (so ``tiny-cpu`` and ``--speed`` calibrate it
  as the SGLang personality): prefill part ``prefill_fixed + per_token·N + attention_per_pair
  · Σ n·(past + n/2)`` over the prompt tokens ``N`` of the batch (if any), plus decode part
  ``max(decode_floor, decode_per_request·B) + decode_per_context_token·ΣL + overhead`` for
  the ``B`` decoding slots with context ``ΣL`` (if any).
* **Context per slot** ``n_ctx``: a prompt of ``n_ctx`` tokens or more is refused
  (:class:`ContextTooLong`, llama.cpp's 400 ``exceed_context_size_error``); generation
  stops at ``n_ctx`` tokens in the slot (finish ``length``).
* **Abort** frees the slot at once; it keeps the tokens computed so far.
* **Counters** as llama.cpp's ``/metrics``: prompt tokens *computed* and *cached* are added
  when a prompt completes, predicted tokens when a request finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from simulator.model.profiles import DEFAULT_PROFILE, Profile, get_profile
from simulator.model.radix_cache import (
    TOKEN_BYTES,
    common_prefix_bytes,
    decode_tokens,
    encode_tokens,
)
from simulator.model.requests import (
    DEFAULT_EOS,
    Finish,
    OutputSource,
    OutputTokenizer,
    RequestOutput,
    SimRequest,
    StepKind,
    StepResult,
    output_source,
    planned_output,
    pseudo_text_output,
)
from simulator.model.settings import WorkerSettings

SLOT_PROMPT_SIMILARITY = 0.1  # llama.cpp --slot-prompt-similarity
N_BATCH = 2048  # llama.cpp --batch-size


class ContextTooLong(ValueError):
    """A prompt that does not fit one slot (llama.cpp answers 400)."""

    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it"
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


def common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two keys (``encode_tokens``) share from the start."""
    return common_prefix_bytes(a, 0, b, min(len(a), len(b))) // TOKEN_BYTES


class _SlotReq:
    """One request, waiting or in a slot."""

    __slots__ = (
        "arrival",
        "assigned_at",
        "cached",
        "eos",
        "first_token_at",
        "key",
        "out_len",
        "output_ids",
        "past",
        "prompt_len",
        "rid",
        "slot",
        "stream",
        "target",
        "task_id",
    )

    def __init__(
        self, req: SimRequest, key: bytes, output_ids: list[int], eos: bool, now: float, task: int
    ) -> None:
        self.rid = req.rid
        self.key = key
        self.prompt_len = len(key) // TOKEN_BYTES
        self.output_ids = output_ids
        self.target = len(output_ids)
        self.eos = eos
        self.stream = req.stream
        self.arrival = now
        self.task_id = task
        self.slot: Slot | None = None
        self.assigned_at: float | None = None
        self.first_token_at: float | None = None
        self.cached = 0
        self.past = 0  # prompt tokens with KV in the slot (cached + computed)
        self.out_len = 0  # tokens sampled


@dataclass
class Slot:
    """One llama.cpp slot: its token sequence and the request using it, if any."""

    id: int
    n_ctx: int
    content: bytes = b""  # tokens with KV (encode_tokens)
    req: _SlotReq | None = None
    last_used: float = -1.0  # release time; -1: never used (first in LRU order)
    used: bool = False
    n_prompt_tokens: int = 0  # of the last request: prompt length
    n_prompt_tokens_processed: int = 0  # of the last request: prompt tokens computed
    n_decoded: int = 0
    n_remain: int = 0
    task_id: int = -1
    last_rid: str | None = None  # the request using it, or that used it last

    @property
    def tokens(self) -> int:
        return len(self.content) // TOKEN_BYTES

    @property
    def is_processing(self) -> bool:
        return self.req is not None


@dataclass
class SlotCounters:
    """Cumulative figures, named as llama.cpp's ``/metrics``."""

    prompt_tokens: int = 0  # computed (cached excluded)
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    n_decode: int = 0  # batches (llama_decode calls)
    n_busy_slots: int = 0  # Σ busy slots over batches
    n_tokens_max: int = 0  # longest sequence seen in a slot
    finished: int = 0
    aborted: int = 0
    requests_submitted: int = 0
    busy_s: float = 0.0


@dataclass
class SlotWorkerModel:
    """One simulated llama.cpp worker (see module docstring)."""

    profile: Profile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    slots: int = 2
    n_ctx: int | None = None  # per slot; default: the profile's context length / slots
    n_batch: int = N_BATCH
    slot_prompt_similarity: float = SLOT_PROMPT_SIMILARITY
    seed: int = 0
    output_source: OutputSource = pseudo_text_output
    eos_token_id: int = DEFAULT_EOS

    @classmethod
    def from_config(
        cls, config: WorkerSettings, tokenizer: OutputTokenizer | None = None
    ) -> SlotWorkerModel:
        """The model of one worker configured by ``config`` (a :class:`simulator.config.SimConfig`
        with ``engine="llamacpp"``); ``tokenizer``: where output tokens and EOS come from."""
        profile = config.resolved_profile()
        context = config.context_length or profile.context_length
        model = cls(
            profile=profile, slots=config.slots, n_ctx=context // config.slots, seed=config.seed
        )
        if tokenizer is not None:
            model.output_source = output_source(tokenizer)
            model.eos_token_id = tokenizer.eos_token_id
        return model

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if self.n_ctx is None:
            self.n_ctx = self.profile.context_length // self.slots
        if self.n_ctx < 2:
            raise ValueError("the context per slot must be at least 2 tokens")
        if self.n_batch < 1:
            raise ValueError("n_batch must be at least 1")
        self.slot_list = [Slot(i, self.n_ctx) for i in range(self.slots)]
        self._waiting: deque[_SlotReq] = deque()
        self._by_rid: dict[str, _SlotReq] = {}
        self._pending: list[RequestOutput] = []
        self._tasks = 0
        self.counters = SlotCounters()
        self._now = 0.0

    # ------------------------------------------------------------------ requests
    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request; it takes a slot at a later :meth:`step`.

        Raises :class:`ContextTooLong` for a prompt that does not fit a slot, ValueError
        for an empty prompt or a duplicate id."""
        if req.rid in self._by_rid:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        prompt = req.prompt_ids
        key = prompt if isinstance(prompt, bytes) else encode_tokens(list(prompt))
        prompt_len = len(key) // TOKEN_BYTES
        if prompt_len == 0:
            raise ValueError("The prompt is empty.")
        assert self.n_ctx is not None
        if prompt_len >= self.n_ctx:
            raise ContextTooLong(prompt_len, self.n_ctx)
        limit = min(max(req.max_new_tokens, 0), self.n_ctx - prompt_len)
        output, eos = planned_output(
            req, key, limit, self.seed, self.output_source, self.eos_token_id
        )
        r = _SlotReq(req, key, output, eos, now, self._tasks)
        self._tasks += 1
        self._by_rid[r.rid] = r
        self._waiting.append(r)
        self.counters.requests_submitted += 1

    def abort(self, rid: str, now: float) -> None:
        """Abort a waiting or running request; its slot is free at once."""
        r = self._by_rid.pop(rid, None)
        if r is None:
            return
        if r.slot is None:
            self._waiting.remove(r)
        else:
            self._release(r, now)
        self._pending.append(
            self._output(r, 0, False, Finish("abort", r.out_len, message="Aborted"), now)
        )
        self.counters.aborted += 1

    def has_request(self, rid: str) -> bool:
        return rid in self._by_rid

    def choose_slot(self, key: bytes) -> tuple[Slot, int] | None:
        """The idle slot a prompt would take and its common prefix with it (None: all busy)."""
        prompt_len = len(key) // TOKEN_BYTES
        best: Slot | None = None
        best_len = 0
        for slot in self.slot_list:
            if slot.req is not None or not slot.content:
                continue
            lcp = common_prefix(slot.content, key)
            if lcp > best_len and lcp / prompt_len > self.slot_prompt_similarity:
                best, best_len = slot, lcp
        if best is not None:
            return best, best_len
        idle = [s for s in self.slot_list if s.req is None]
        if not idle:
            return None
        lru = min(idle, key=lambda s: (s.last_used, s.id))
        return lru, common_prefix(lru.content, key)

    # ------------------------------------------------------------------ the step
    def step(self, now: float) -> StepResult | None:
        """Assign waiting requests to idle slots, then run one batch starting at ``now``."""
        self._now = now
        outputs = self._pending
        self._pending = []
        self._assign(now)
        decoding = [s for s in self.slot_list if s.req is not None and s.req.out_len > 0]
        budget = self.n_batch - len(decoding)
        prefill: list[tuple[Slot, int]] = []
        for slot in self.slot_list:
            r = slot.req
            if r is None or r.out_len > 0 or budget <= 0:
                continue
            n = min(r.prompt_len - r.past, budget)
            prefill.append((slot, n))
            budget -= n
        if not decoding and not prefill:
            return StepResult(now, 0.0, "idle", outputs) if outputs else None
        duration = self._duration(prefill, decoding)
        end = now + duration
        for slot in decoding:
            self._decode(slot, end, outputs)
        for slot, n in prefill:
            self._prefill(slot, n, end, outputs)
        counters = self.counters
        counters.n_decode += 1
        counters.n_busy_slots += len(decoding) + len(prefill)
        counters.busy_s += duration
        kind: StepKind = "mixed" if prefill and decoding else "prefill" if prefill else "decode"
        new_tokens = sum(n for _, n in prefill)
        return StepResult(now, duration, kind, outputs, new_tokens, len(decoding))

    def _assign(self, now: float) -> None:
        while self._waiting:
            choice = self.choose_slot(self._waiting[0].key)
            if choice is None:
                return
            slot, lcp = choice
            r = self._waiting.popleft()
            cached = min(lcp, r.prompt_len - 1)
            slot.content = slot.content[: cached * TOKEN_BYTES]
            slot.req = r
            slot.used = True
            slot.task_id = r.task_id
            slot.last_rid = r.rid
            slot.n_prompt_tokens = r.prompt_len
            slot.n_prompt_tokens_processed = 0
            slot.n_decoded = 0
            slot.n_remain = r.target
            r.slot = slot
            r.assigned_at = now
            r.cached = r.past = cached

    def _duration(self, prefill: list[tuple[Slot, int]], decoding: list[Slot]) -> float:
        p = self.profile
        duration = 0.0
        if prefill:
            new = sum(n for _, n in prefill)
            pairs = 0.0
            for slot, n in prefill:
                assert slot.req is not None
                pairs += n * (slot.req.past + n / 2)
            duration += p.prefill_fixed_s + p.prefill_per_token_s * new
            duration += p.attention_per_pair_s * pairs
        if decoding:
            context = sum(s.tokens + 1 for s in decoding)
            duration += max(p.decode_floor_s, p.decode_per_request_s * len(decoding))
            duration += p.decode_per_context_token_s * context + p.decode_overhead_s
        return duration

    def _prefill(self, slot: Slot, n: int, end: float, outputs: list[RequestOutput]) -> None:
        r = slot.req
        assert r is not None
        slot.content = r.key[: (r.past + n) * TOKEN_BYTES]
        r.past += n
        slot.n_prompt_tokens_processed += n
        if r.past < r.prompt_len:
            return  # continues next step
        counters = self.counters
        counters.prompt_tokens += r.prompt_len - r.cached
        counters.prompt_tokens_cached += r.cached
        assert r.assigned_at is not None
        counters.prompt_seconds += end - r.assigned_at
        r.first_token_at = end
        if r.target == 0:
            self._finish(r, end, outputs, first=True)
            return
        self._sample(r, end, outputs)

    def _decode(self, slot: Slot, end: float, outputs: list[RequestOutput]) -> None:
        r = slot.req
        assert r is not None
        slot.content += encode_tokens([r.output_ids[r.out_len - 1]])  # the last sample's KV
        self._sample(r, end, outputs)

    def _sample(self, r: _SlotReq, end: float, outputs: list[RequestOutput]) -> None:
        first = r.out_len == 0
        r.out_len += 1
        slot = r.slot
        assert slot is not None
        slot.n_decoded = r.out_len
        slot.n_remain = r.target - r.out_len
        if r.out_len >= r.target:
            self._finish(r, end, outputs, first=first)
        elif first or r.stream:
            outputs.append(self._output(r, 1, first, None, end))

    def _finish(self, r: _SlotReq, end: float, outputs: list[RequestOutput], first: bool) -> None:
        if r.eos and r.out_len == r.target:
            finish = Finish("stop", r.out_len, matched=self.eos_token_id)
        else:
            finish = Finish("length", r.out_len)
        del self._by_rid[r.rid]
        self._release(r, end)
        counters = self.counters
        counters.finished += 1
        counters.tokens_predicted += r.out_len
        if r.first_token_at is not None:
            counters.tokens_predicted_seconds += end - r.first_token_at
        outputs.append(self._output(r, 1 if r.target else 0, first, finish, end))

    def _release(self, r: _SlotReq, now: float) -> None:
        slot = r.slot
        if slot is None:
            return
        slot.req = None
        slot.last_used = now
        self.counters.n_tokens_max = max(self.counters.n_tokens_max, slot.tokens)

    def _output(
        self, r: _SlotReq, new: int, first: bool, finish: Finish | None, when: float
    ) -> RequestOutput:
        return RequestOutput(
            rid=r.rid,
            new_tokens=new,
            completion_tokens=r.out_len,
            prompt_tokens=r.prompt_len,
            cached_tokens=r.cached,
            first_token=first,
            finish=finish,
            arrival=r.arrival,
            time=when,
            output_ids=r.output_ids,
        )

    # ------------------------------------------------------------------ state
    @property
    def now(self) -> float:
        """The start time of the last step."""
        return self._now

    @property
    def requests_processing(self) -> int:
        """Requests in a slot (llama.cpp's gauge)."""
        return sum(1 for s in self.slot_list if s.req is not None)

    @property
    def requests_deferred(self) -> int:
        """Requests waiting for a slot (llama.cpp's gauge)."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._by_rid and not self._pending

    def slot_of(self, rid: str) -> Slot | None:
        """The slot ``rid`` runs in, or ran in while no later request took it."""
        return next((s for s in self.slot_list if s.last_rid == rid), None)

    def slot_contents(self) -> list[list[int]]:
        """Each slot's tokens (for tests and ``/slots``)."""
        return [decode_tokens(slot.content) for slot in self.slot_list]
