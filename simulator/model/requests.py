"""What goes into a worker model and what comes out: the types both models share.

:class:`simulator.model.radix_worker.WorkerModel` (SGLang) and
:class:`simulator.model.slots.SlotWorkerModel` (llama.cpp) take a :class:`SimRequest`, report
:class:`RequestOutput` rows in a :class:`StepResult` per step, and end a request with a
:class:`Finish`; :class:`simulator.model.driver.ModelDriver` and the offline replay read only
these. :func:`planned_output` fixes a request's whole output at submission (deterministic, so
a replay and a live run generate the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import xxhash

from simulator.model.tokenizer import default_tokenizer

FinishKind = Literal["stop", "length", "abort"]
StepKind = Literal["prefill", "decode", "mixed", "idle"]


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
    adapter: str | None = None  # the LoRA adapter's name (None: the base model)
    stream: bool = True  # report every new token (else only the first token and the finish)
    output_ids: Sequence[int] | None = None  # planned output; default: pseudo-text


@dataclass(frozen=True, slots=True)
class Finish:
    kind: FinishKind
    length: int = 0  # completion tokens at finish
    matched: int | None = None  # EOS token id for "stop"
    message: str | None = None  # for "abort"
    status_code: int | None = None
    err_type: str | None = None  # the reason's err_type (default: the status's name)


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
    cached_host: int = 0  # of cached_tokens, loaded from the host tier (HiCache)


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


OutputSource = Callable[[bytes, int, int], list[int]]
DEFAULT_EOS = default_tokenizer().eos_token_id


class OutputTokenizer(Protocol):
    """What a worker model needs of its tokenizer: output text and the EOS id."""

    @property
    def eos_token_id(self) -> int: ...

    def pseudo_output_ids(self, seed: int, n: int) -> list[int]: ...


def output_source(tokenizer: OutputTokenizer) -> OutputSource:
    """Deterministic output from ``tokenizer``'s ring, chosen by the prompt's hash (same
    prompt and seed → same text, like temperature 0)."""

    def source(prompt_key: bytes, seed: int, n: int) -> list[int]:
        return tokenizer.pseudo_output_ids(xxhash.xxh64_intdigest(prompt_key, seed), n)

    return source


pseudo_text_output: OutputSource = output_source(default_tokenizer())  # pseudo-English


def planned_output(
    req: SimRequest,
    key: bytes,
    limit: int,
    seed: int,
    source: OutputSource,
    eos_token_id: int = DEFAULT_EOS,
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
        output[-1] = eos_token_id
    return output, eos
