"""Data-parallel ranks of one simulated SGLang server (SGLang's ``--dp-size N``).

SGLang 0.5.23 with ``--dp-size N`` (data parallelism without DP attention) runs N whole
replicas of the model behind one HTTP server and one tokenizer: each rank has its own
scheduler, radix cache and KV pool. Neither ``max_total_num_tokens`` nor
``max_running_requests`` is split between ranks (only DP attention divides them): each
replica has GPUs of its own. So here every rank is a :class:`WorkerModel` built from the
same configuration (``capacity_tokens`` each), driven by a driver of its own on the
server's event loop, with its own KV event publisher on ``port + rank``.

Dispatch, as SGLang's ``DataParallelController`` with ``--load-balance-method auto``
(``round_robin`` outside PD disaggregation): a request naming ``routed_dp_rank`` (or its
deprecated alias ``data_parallel_rank``) goes to that rank; any other request goes to the
next rank in turn (one counter for the server; a batch's requests take a turn each);
health checks take turns on a counter of their own. The tokenizer refuses a rank outside
``[0, N)`` with ``ValueError("routed_dp_rank=R out of range [0, N)")`` before anything
else about the request is checked (``routed_dp_rank=0`` on a single rank is ignored);
each route answers it as its other ``ValueError``s (context too long).

How a route reads the rank (:func:`routed_rank`): both fields are ``Optional[int]`` to
pydantic (lax: ``true``, ``1.0`` and ``"1"`` are 1); ``/generate``'s JSON contract then
wants a JSON integer in ``routed_dp_rank`` (``{"error": "invalid type: string \\"1\\",
expected i64"}``); the OpenAI routes take ``X-Data-Parallel-Rank`` before the body
(``x-override-routed-dp-rank`` needs ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES``, off by
default, and is not modelled).

All of this is read from SGLang 0.5.23's source (``tokenizer_manager``,
``data_parallel_controller``, ``v1_loads``, ``metrics_collector``, ``output_streamer``,
``runtime_context.describe_kv_events_publisher``), not checked against a server running
with ``--dp-size`` (``tests/sglang`` runs one rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simulator.http import api
from simulator.http.api import ApiError
from simulator.model.radix_worker import WorkerModel

if TYPE_CHECKING:
    from simulator.http.kv_publisher import KVEventPublisher

RANK_HEADER = "X-Data-Parallel-Rank"
_BIND_ATTEMPTS = 32


@dataclass(eq=False)
class DPRank:
    """One data-parallel rank: its model (scheduler and radix cache) and KV publisher."""

    rank: int
    engine: WorkerModel
    kv_events: KVEventPublisher | None


class DPRanks:
    """A server's ranks and SGLang's dispatch among them (see module docstring)."""

    def __init__(self, ranks: Sequence[DPRank]) -> None:
        assert ranks, "a server has at least one rank"
        self.ranks = list(ranks)
        self._next = 0
        self._next_health = 0

    def __len__(self) -> int:
        return len(self.ranks)

    def check(self, routed: int | None) -> int | None:
        """The tokenizer's check of a requested rank: the rank, or None when none is
        named (or 0 on a single rank); ``ValueError`` with SGLang's text if out of range."""
        n = len(self.ranks)
        if routed is None or (n <= 1 and routed == 0):
            return None
        if routed < 0 or routed >= n:
            raise ValueError(f"routed_dp_rank={routed} out of range [0, {n})")
        return routed

    def dispatch(self, routed: int | None) -> DPRank:
        """The rank a request goes to: ``routed`` (already checked), else the next one."""
        if routed is not None:
            return self.ranks[routed]
        rank = self.ranks[self._next]
        self._next = (self._next + 1) % len(self.ranks)
        return rank

    def health_rank(self) -> DPRank:
        """The rank the next health check goes to (a round robin of its own)."""
        rank = self.ranks[self._next_health]
        self._next_health = (self._next_health + 1) % len(self.ranks)
        return rank


# ---------------------------------------------------------------------- the requested rank
def _lax_int(name: str, value: Any) -> int:
    """``Optional[int]`` as pydantic reads it in lax mode (FastAPI's 400 otherwise)."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if number.is_integer():
            return int(number)
        raise _int_error(name, value, "int_parsing", ", unable to parse string as an integer")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise _int_error(name, value, "int_from_float", ", got a number with a fractional part")
    raise _int_error(name, value, "int_type", "")


def _int_error(name: str, value: Any, kind: str, why: str) -> ApiError:
    message = f"Input should be a valid integer{why}"
    return api.validation_error(
        [{"type": kind, "loc": ("body", name), "msg": message, "input": value}]
    )


def _json_type(value: Any) -> str:
    """serde's name for an unexpected JSON value, as in SGLang's contract errors."""
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def routed_rank(
    body: Mapping[str, Any], native: bool, headers: Mapping[str, str] | None = None
) -> int | None:
    """The rank a request names: ``routed_dp_rank``, else ``data_parallel_rank``; on the
    OpenAI routes ``X-Data-Parallel-Rank`` (``headers``) wins over both. Raises
    :class:`ApiError` with SGLang's answer to a value that is no integer."""
    values: dict[str, int] = {}
    for name in ("routed_dp_rank", "data_parallel_rank"):
        if body.get(name) is not None:
            values[name] = _lax_int(name, body[name])
    raw = body.get("routed_dp_rank")
    if native and raw is not None and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise ApiError(400, {"error": f"invalid type: {_json_type(raw)}, expected i64"})
    header = headers.get(RANK_HEADER) if headers is not None else None
    if header is not None:
        try:
            return int(header)
        except ValueError:
            message = f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{header}'"
            raise api.openai_error(400, message) from None
    return values.get("routed_dp_rank", values.get("data_parallel_rank"))


# ---------------------------------------------------------------------- KV event publishers
def start_publishers(publishers: Sequence[KVEventPublisher]) -> None:
    """Start one publisher per rank, rank r on the ports of rank 0 + r.

    Configured ports are offset per rank at construction. An ephemeral endpoint (port
    ``*`` or ``0``, a simulator extension for tests) binds rank 0 anywhere and the other
    ranks on the ports after it, trying another place when one of those is taken; nothing
    publishes until every rank is bound.
    """
    import zmq  # optional extra, as the publisher

    from simulator.http.kv_publisher import is_ephemeral

    first = publishers[0]
    config = first.config
    ephemeral, replay_ephemeral = (
        is_ephemeral(config.endpoint),
        is_ephemeral(config.replay_endpoint),
    )
    for _ in range(_BIND_ATTEMPTS):
        first.bind()
        try:
            for r, publisher in enumerate(publishers[1:], start=1):
                port = first.port + r if ephemeral and first.port is not None else None
                replay = first.replay_port
                replay = replay + r if replay_ephemeral and replay is not None else None
                publisher.bind(port, replay)
        except zmq.ZMQError:
            for publisher in publishers:
                publisher.unbind()
            if not (ephemeral or replay_ephemeral):
                raise
            continue
        for publisher in publishers:
            publisher.start()
        return
    raise OSError(f"no {len(publishers)} consecutive free ports for the KV event publishers")
