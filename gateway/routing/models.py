"""Per-model settings on the request path (``models:`` in the configuration): which entry
a request's model falls under, and the timeouts its attempts get.

Contract:
- An entry is keyed by a name its workers serve under. A request's (base) model falls
  under an entry when it is the entry's name, or another name of a worker that serves
  under the entry's name (``Worker.serves``: served_model_name, model path, /v1/models
  ids; the first such name in sorted order, as ``gateway.exact.choice`` picks a
  tokenizer). A model under no entry resolves to None: the top-level policy and timeouts.
- The entry's name is what the routing core picks the policy set by
  (``RoutingCore.policies_for``); its timeouts are resolved here, once, at start (unset:
  the server's).
- No ``models:`` section: nothing is looked up (the single-model case is unchanged).

Cost: one dict lookup per request; a model that is not an entry's name adds one pass
over the workers (only when some entry exists).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.workers.registry import Worker


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """What one ``models:`` entry sets for its requests' attempts."""

    key: str  # the entry's name: the routing core's policy set is picked by it
    request_timeout_s: float  # bound on one attempt (the entry's, else the server's)
    first_byte_timeout_s: float | None  # the entry's (0: none), None: the pool's own


class ModelRoutes:
    """The ``models:`` entries, and which one a request's model falls under."""

    def __init__(self, routes: Mapping[str, ModelRoute]) -> None:
        self._routes = dict(routes)

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ModelRoutes:
        default = config.server.request_timeout_s
        return cls(
            {
                name: ModelRoute(
                    name,
                    default if m.request_timeout_s is None else m.request_timeout_s,
                    m.first_byte_timeout_s,
                )
                for name, m in config.models.items()
            }
        )

    def __bool__(self) -> bool:
        return bool(self._routes)

    def resolve(self, model: str | None, workers: Iterable[Worker]) -> ModelRoute | None:
        """The entry ``model`` (a request's base model) falls under, given the workers."""
        routes = self._routes
        if not routes or model is None:
            return None
        route = routes.get(model)
        if route is not None:
            return route
        for worker in workers:
            if worker.serves(model):
                meta = worker.metadata
                names = meta.models | ({meta.model} if meta.model else set())
                for name in sorted(names):
                    if name in routes:
                        return routes[name]
        return None
