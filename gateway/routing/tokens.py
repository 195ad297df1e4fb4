"""Token accounting in the engine's tokens: characters per token, learnt from what
workers report.

The gateway sees characters (UTF-8 bytes of the canonical prompt, ``routing.request``)
and the engines count tokens. A fixed ratio breaks on real tokenizers: measured on a
real SGLang server with a small BPE vocabulary, ~1.2 bytes per token against the 4.0
assumed, so the index credited each worker with three times the prompts its KV holds.
Every SGLang (and OpenAI-compatible) answer reports ``usage.prompt_tokens``; this module
learns from it.

Contract:
- :meth:`TokenAccounting.observe` takes one answered request: its canonical prompt's
  characters and the worker's ``prompt_tokens``. It updates two estimates of characters
  per token: one per model (the request's ``model``; requests naming none share one), which
  sizes prompts before a worker is chosen (:meth:`estimate`; a model not learnt yet takes
  the estimate of requests naming none, else the prior; at most ``MAX_MODELS`` names are
  kept, client-chosen as they are), and one per worker, which
  sizes that worker's prefix index (blocks of ``block_chars`` characters → tokens):
  when a worker's estimate moves by more than ``retune`` (10 %) from the value last handed
  out, ``on_worker_ratio(worker_id, tokens_per_block)`` is called, so its capacity in
  blocks and the corrections from its ``cached_tokens`` are in its engine's tokens.
- A model's estimate is the median of the estimates of the workers that answered it, so
  one worker reporting nonsense (a hostile or broken one) moves only its own estimate,
  never the ratio every other worker's requests are sized with.
- Each worker's estimate is a ratio of exponentially weighted sums (characters / tokens, each
  observation weighted by its size, older ones decayed by ``decay`` per observation),
  started from the configured prior (``request.chars_per_token``) with the weight of a
  small prompt, so the first real answer moves it most of the way. Observations whose
  own ratio is outside ``[0.1, 64]`` characters per token (a worker that counts
  something else) are ignored; estimates stay within the same bounds.
- Requests whose prompt is token ids are exact already and teach nothing
  (:attr:`RouteRequest.tokens_exact`).
- The chat template's own tokens (role markers) are counted in ``prompt_tokens`` and not
  in the characters: they lower the ratio a little, which is what routing wants (it sizes
  what the engine caches, template included).

Cost: O(1) per observation; per estimate O(1) but after an observation of its model
(the median over that model's workers, O(w log w) in C, computed then kept until the
next observation); one small record per model and per worker.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.routing.request import RouteRequest

MIN_CHARS_PER_TOKEN = 0.1
MAX_CHARS_PER_TOKEN = 64.0
_PRIOR_TOKENS = 64.0  # the prior counts as one prompt of this many tokens
_ANY_MODEL = ""  # the key of requests that name no model
# Model names come from clients: beyond this many, further names share the ``""``
# estimate (memory and metric labels stay bounded whatever clients send).
MAX_MODELS = 32


@dataclass(slots=True)
class CharsPerToken:
    """Characters per token from (characters, tokens) pairs, with forgetting."""

    chars: float
    tokens: float
    samples: int = 0

    @classmethod
    def prior(cls, chars_per_token: float) -> CharsPerToken:
        return cls(chars_per_token * _PRIOR_TOKENS, _PRIOR_TOKENS)

    @property
    def value(self) -> float:
        ratio = self.chars / self.tokens
        return min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, ratio))

    def observe(self, chars: int, tokens: int, decay: float) -> None:
        self.chars = self.chars * decay + chars
        self.tokens = self.tokens * decay + tokens
        self.samples += 1


class TokenAccounting:
    """Per-model and per-worker characters per token (see the module contract)."""

    def __init__(
        self,
        prior_chars_per_token: float = 4.0,
        block_chars: int = 64,
        *,
        decay: float = 0.98,
        retune: float = 0.10,
        on_worker_ratio: Callable[[str, float], None] | None = None,
    ) -> None:
        if prior_chars_per_token <= 0 or block_chars <= 0 or not 0 < decay <= 1:
            raise ValueError("prior, block_chars and decay must be positive (decay <= 1)")
        self.prior = prior_chars_per_token
        self.block_chars = block_chars
        self._decay = decay
        self._retune = retune
        self.on_worker_ratio = on_worker_ratio
        self._models: dict[str, dict[str, CharsPerToken]] = {}  # model -> worker -> estimate
        self._workers: dict[str, CharsPerToken] = {}
        self._handed: dict[str, float] = {}  # worker -> chars per token last handed out
        # per model, its workers' estimates as numbers (updated at each observation), and
        # the median of them last computed (dropped when an observation changes one):
        # the median over every worker per request was 0.2-0.3 ms at 256 workers
        # (BENCHMARKS.md, "Scale")
        self._values: dict[str, dict[str, float]] = {}
        self._medians: dict[str, float] = {}

    def chars_per_token(self, model: str | None) -> float:
        key = model or _ANY_MODEL
        if key not in self._models:
            key = _ANY_MODEL
        ratio = self._medians.get(key)
        if ratio is None:
            values = self._values.get(key)
            ratio = self.prior if not values else statistics.median(values.values())
            self._medians[key] = ratio
        return ratio

    def worker_chars_per_token(self, worker_id: str) -> float:
        est = self._workers.get(worker_id)
        return self.prior if est is None else est.value

    def estimate(self, req: RouteRequest) -> None:
        """Size ``req``'s prompt in its model's tokens (token-id prompts stay exact)."""
        if req.tokens_exact or req.prompt_chars <= 0:
            return
        req.prompt_tokens = math.ceil(req.prompt_chars / self.chars_per_token(req.model))

    def observe(self, worker_id: str, req: RouteRequest, prompt_tokens: int | None) -> None:
        """Learn from a worker's ``usage.prompt_tokens`` for ``req``."""
        if prompt_tokens is None or prompt_tokens <= 0 or req.tokens_exact:
            return
        chars = req.prompt_chars
        if chars <= 0 or not MIN_CHARS_PER_TOKEN <= chars / prompt_tokens <= MAX_CHARS_PER_TOKEN:
            return
        model = req.model or _ANY_MODEL
        if model not in self._models and len(self._models) >= MAX_MODELS:
            model = _ANY_MODEL
        for table, key in ((self._models.setdefault(model, {}), worker_id),
                           (self._workers, worker_id)):  # fmt: skip
            est = table.get(key)
            if est is None:
                est = table[key] = CharsPerToken.prior(self.prior)
            est.observe(chars, prompt_tokens, self._decay)
        self._values.setdefault(model, {})[worker_id] = self._models[model][worker_id].value
        self._medians.pop(model, None)
        self._maybe_retune(worker_id)

    def _maybe_retune(self, worker_id: str) -> None:
        now = self.worker_chars_per_token(worker_id)
        handed = self._handed.get(worker_id, self.prior)
        if abs(now - handed) <= self._retune * handed:
            return
        self._handed[worker_id] = now
        if self.on_worker_ratio is not None:
            self.on_worker_ratio(worker_id, self.block_chars / now)

    def forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._handed.pop(worker_id, None)
        for model in list(self._models):
            self._models[model].pop(worker_id, None)
            self._values[model].pop(worker_id, None)
            if not self._models[model]:
                del self._models[model], self._values[model]
        self._medians.clear()

    def describe(self) -> dict[str, Any]:
        """For ``/debug/index``: the prior and every learnt estimate."""

        models = {
            m: {
                "chars_per_token": self.chars_per_token(m),
                "samples": sum(e.samples for e in t.values()),
                "workers": len(t),
            }
            for m, t in self._models.items()
        }
        workers = {k: {"chars_per_token": e.value, "samples": e.samples}
                   for k, e in self._workers.items()}  # fmt: skip
        return {"prior_chars_per_token": self.prior, "models": models, "workers": workers}

    def model_ratios(self) -> dict[str, float]:
        """Characters per token by model (``""``: requests naming none), for metrics."""
        return {m: self.chars_per_token(m) for m in self._models}
