"""The per-model characters-per-token median is kept between observations
(``TokenAccounting.chars_per_token``) and always equals the median over the model's
workers' current estimates."""

from __future__ import annotations

import random
import statistics

from gateway.routing.request import ApiKind, RequestSettings, RouteRequest, parse_request
from gateway.routing.tokens import TokenAccounting


def _req(chars: int, model: str) -> RouteRequest:
    body = b'{"model":"%s","messages":[{"role":"user","content":"%s"}]}' % (
        model.encode(),
        b"x" * chars,
    )
    return parse_request(ApiKind.CHAT, body, {}, RequestSettings())


def _median(acc: TokenAccounting, model: str) -> float:
    workers = acc.describe()["models"]
    assert model in workers
    # recomputed from scratch, from every worker's estimate of that model
    table = acc._models[model]
    return statistics.median(e.value for e in table.values())


def test_the_kept_median_follows_every_observation_and_forget() -> None:
    rng = random.Random(3)
    acc = TokenAccounting(4.0, 64)
    assert acc.chars_per_token("a") == 4.0  # the prior, nothing learnt
    for i in range(300):
        model = rng.choice(["a", "b"])
        req = _req(rng.randint(100, 3000), model)
        tokens = max(1, int(req.prompt_chars / rng.uniform(1.0, 6.0)))
        acc.observe(f"w{rng.randrange(12)}", req, tokens)
        assert acc.chars_per_token(model) == _median(acc, model)
        assert acc.chars_per_token(model) == acc.chars_per_token(model)
        if i % 50 == 49:
            acc.forget_worker(f"w{rng.randrange(12)}")
            for m in ("a", "b"):
                if m in acc.describe()["models"]:
                    assert acc.chars_per_token(m) == _median(acc, m)
    # a model never seen takes the estimate of requests naming none (the prior here)
    assert acc.chars_per_token("never") == 4.0
    acc.observe("w0", _req(400, ""), 100)
    assert acc.chars_per_token("never") == acc.chars_per_token(None) == _median(acc, "")
