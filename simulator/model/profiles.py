"""Named worker profiles: every constant of the latency and capacity model in one place.

The default, ``llama3-8b-h100``, is the model of PERFORMANCE.md §3 (Llama-3-8B in BF16 on
one H100-80GB; derived, not measured):

* prefill of ``n`` new tokens over ``c`` cached: ``5 ms + 22 µs·n + 1.3 ns·n·(c + n/2)``
  (fresh 1k / 8k / 32k prompt ≈ 28 ms / 229 ms / 1.4 s);
* decode step of a batch of ``B`` requests with total context ``ΣL``:
  ``max(6 ms, 22 µs·B) + 45 ns·ΣL + 0.5 ms``;
* mixed step (``mixed_chunk``, off by default as in SGLang):
  ``max(6 ms, 22 µs·(prefill tokens + B)) + 1.3 ns·Σ prefill pairs + 45 ns·ΣL + 0.5 ms``;
* chunked prefill of 8,192 tokens per step, ``max_prefill_tokens`` 16,384;
* KV pool of ≈ 420k tokens (128 KiB per token).

The constants are parameters to calibrate, not truths: compare routers by ranking and
ratios, never by absolute times.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    # prefill-only step: fixed + per new token + attention over (cached + new/2) per new token
    prefill_fixed_s: float = 5e-3
    prefill_per_token_s: float = 22e-6
    attention_per_pair_s: float = 1.3e-9
    # ...plus, per request, a cost of the cached prefix itself: per cached token and per
    # cached pair (c²/2). 0 on a GPU; real SGLang on the CPU (torch_native attention) pays
    # nearly as much for a hit as for a cold prompt of the same length (tiny-sglang).
    prefill_per_cached_token_s: float = 0.0
    cached_pair_s: float = 0.0
    # decode step: max(floor, per request * B) + per context token * ΣL + overhead
    decode_floor_s: float = 6e-3
    decode_per_request_s: float = 22e-6
    decode_per_context_token_s: float = 45e-9
    decode_overhead_s: float = 0.5e-3
    # scheduler
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    mixed_chunk: bool = False
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    # capacity and hardware facts reported by /server_info, /v1/loads and /metrics
    capacity_tokens: int = 420_000
    context_length: int = 131_072
    kv_bytes_per_token: int = 131_072
    weight_gb: float = 14.96
    graph_gb: float = 0.62
    accelerator: str = "NVIDIA H100 80GB HBM3"
    gpu_memory_gb: float = 79.1
    # seconds the simulated server takes to answer /health (SGLang polls with sleep(1))
    health_check_min_s: float = 0.0

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """Modelled duration of a prefill-only step for one request (seconds)."""
        return (
            self.prefill_fixed_s
            + self.prefill_per_token_s * new_tokens
            + self.attention_per_pair_s * new_tokens * (cached_tokens + new_tokens / 2)
            + self.prefill_per_cached_token_s * cached_tokens
            + self.cached_pair_s * cached_tokens * cached_tokens / 2
        )

    def with_overrides(self, **overrides: Any) -> Profile:
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        return replace(self, **overrides)


_TINY_CPU = Profile(
    name="tiny-cpu",
    description=(
        "a tiny model on a CPU (like REAL_ENGINE.md's llama.cpp setup): ≈0.5 ms per "
        "prompt token, 20 ms decode steps, 16k KV tokens"
    ),
    prefill_fixed_s=2e-3,
    prefill_per_token_s=0.5e-3,
    attention_per_pair_s=20e-9,
    decode_floor_s=20e-3,
    decode_per_request_s=2e-3,
    decode_per_context_token_s=0.5e-6,
    decode_overhead_s=1e-3,
    chunked_prefill_size=2048,
    max_prefill_tokens=4096,
    capacity_tokens=16_384,
    context_length=8192,
    kv_bytes_per_token=8192,
    weight_gb=0.03,
    graph_gb=0.0,
    accelerator="CPU",
    gpu_memory_gb=0.0,
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama3-8b-h100",
            description="Llama-3-8B BF16 on one H100-80GB (PERFORMANCE.md §3); ≈420k KV tokens",
        ),
        Profile(
            name="llama3-8b-h200",
            description="Llama-3-8B BF16 on one H200-141GB: same compute, ≈900k KV tokens",
            capacity_tokens=900_000,
            accelerator="NVIDIA H200",
            gpu_memory_gb=139.8,
        ),
        _TINY_CPU,
        _TINY_CPU.with_overrides(
            name="tiny-llamacpp",
            description=(
                "the project's tiny generated model on llama.cpp, 1 thread on this machine "
                "(docs/REAL_ENGINE.md): cold 2,000 tokens ≈1.66 s, 200 over 1,800 cached "
                "≈0.24 s; use with --engine llamacpp at speed 1"
            ),
            # Fitted (not guessed) to three quiet-machine points of REAL_ENGINE.md (the
            #   shared one, "Measured"): cold ~2,000 tokens 1.66 s; a new ~200-token
            #   message over a cached 1,800-token prefix 0.244 s; an exact repeat 12 ms
            #   (so the per-request fixed part is small).
            # fixed 2 ms, 0.49 ms per new token, 332 ns per attention pair solve the first
            # two and give ~4 ms + a decode step for the third: with a model this narrow,
            # attention over the context costs as much as the matmuls.
            prefill_per_token_s=0.49e-3,
            attention_per_pair_s=332e-9,
            # decode 1-10 ms per token (REAL_ENGINE.md), growing with the context
            decode_floor_s=1e-3,
            decode_per_request_s=0.5e-3,
            decode_per_context_token_s=332e-9,
            decode_overhead_s=0.5e-3,
            max_prefill_tokens=2048,
            capacity_tokens=8192,
        ),
        _TINY_CPU.with_overrides(
            name="tiny-sglang",
            description=(
                "the project's tiny Hugging Face model on real SGLang 0.5.23, CPU, "
                "torch_native attention (docs/REAL_ENGINE.md): cold 1,013 tokens ≈85 ms, "
                "212 new over 3,008 cached ≈223 ms; use at speed 1"
            ),
            # Fitted (not guessed) by `python -m loadtests.engine.sglang_calibrate` on one
            #   server (16,384 KV tokens, page 16), quiet machine, 2026-12-01 16:54 UTC,
            #   medians of 5 (TTFT to the first streamed event, HTTP and tokenizer
            #   included): cold 263 / 513 / 1,013 / 2,013 / 3,013 tokens 33 / 52 / 85 /
            #   174 / 321 ms; ~215 new over 496 / 1,008 / 2,000 / 3,008 cached 56 / 69 /
            #   133 / 223 ms. Non-negative least squares; modelled / measured 0.91-1.04, the
            #   263-token cold prompt 1.16 (39 vs 33 ms); an exact repeat of 1,013, left out
            #   of the fit: 58 ms measured, 55 ms modelled.
            # A hit costs nearly what a cold prompt of the same length does on this
            #   backend, hence the two cached-prefix terms.
            prefill_fixed_s=29.8e-3,
            prefill_per_token_s=27.8e-6,
            prefill_per_cached_token_s=11.0e-6,
            attention_per_pair_s=45.3e-9,
            cached_pair_s=27.5e-9,
            # decode, same run: 8.6 ms per token at a 200-token context, 15.7 ms at 3,000
            #   (33 tokens, ignore_eos): 8.1 ms + 2.55 µs per context token. The batch term
            #   (decode_per_request_s, tiny-cpu's 2 ms) was not measured.
            decode_floor_s=7.6e-3,
            decode_per_context_token_s=2.55e-6,
            decode_overhead_s=0.5e-3,
            # the server's /server_info: chunked_prefill_size 4,096, max_prefill_tokens
            #   16,384; the fleet's default pool of 8,192 KV tokens; the model's context
            chunked_prefill_size=4096,
            max_prefill_tokens=16384,
            capacity_tokens=8192,
            context_length=32768,
        ),
    )
}
DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str) -> Profile:
    return named(PROFILES, name, "profile")


def named(table: dict[str, _T], name: str, kind: str) -> _T:
    """``table[name]``, else ``ValueError`` naming the ``kind`` and the known names."""
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None
