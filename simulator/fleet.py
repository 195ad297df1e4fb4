"""An in-process fleet of simulated workers, for tests, benchmarks and demos.

    async with await SimulatedFleet.start(3, SimConfig(speed=50)) as fleet:
        fleet.urls                  # ["http://127.0.0.1:PORT", ...]
        fleet.workers[0].model      # served model name ("sim-model")
        fleet.workers[0].engine     # the WorkerModel (radix cache, queues, counters), or the
                                    # SlotWorkerModel with SimConfig(engine="llamacpp");
                                    # with SimConfig(dp_size=n), rank 0's of
        fleet.workers[0].dp.ranks   # n ranks (engine, kv_events each)
        fleet.workers[0].faults     # mutable Faults (or POST /_sim/faults)
        fleet.workers[0].stats      # SimStats (or GET /_sim/stats)
        await fleet.stop_worker(1)      # like a killed process: listener closed, connections cut
        await fleet.restart_worker(1)   # same port, fresh state

All workers share the caller's event loop. ``SimConfig(engine="llamacpp", slots=n)`` makes
them llama.cpp servers (:mod:`simulator.http.llamacpp`) instead of SGLang workers.
"""

from __future__ import annotations

from types import TracebackType

from simulator.config import SimConfig
from simulator.http.llamacpp import LlamaCppWorker
from simulator.http.sglang import SimulatedWorker

__all__ = ["LlamaCppWorker", "SimConfig", "SimulatedFleet", "SimulatedWorker", "make_worker"]


def make_worker(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0
) -> SimulatedWorker | LlamaCppWorker:
    """A worker of ``config.engine``'s personality (not started)."""
    if config.engine == "llamacpp":
        return LlamaCppWorker(config, host, port, index)
    return SimulatedWorker(config, host, port, index)


class SimulatedFleet:
    def __init__(self, config: SimConfig, host: str) -> None:
        self.config = config
        self.host = host
        self.workers: list[SimulatedWorker | LlamaCppWorker] = []
        self._ports: list[int] = []

    @classmethod
    async def start(
        cls, n: int, config: SimConfig | None = None, host: str = "127.0.0.1", base_port: int = 0
    ) -> SimulatedFleet:
        """Start ``n`` workers on ``base_port .. base_port+n-1`` (0: ephemeral ports)."""
        fleet = cls(config or SimConfig(), host)
        try:
            for i in range(n):
                worker = make_worker(fleet.config, host, base_port + i if base_port else 0, i)
                await worker.start()
                fleet.workers.append(worker)
                fleet._ports.append(worker.port)
        except BaseException:
            await fleet.close()
            raise
        return fleet

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self._ports]

    async def stop_worker(self, i: int) -> None:
        """Kill worker ``i``: its listener is closed and its open connections are cut."""
        await self.workers[i].stop(kill=True)

    async def restart_worker(self, i: int) -> None:
        """Start worker ``i`` again on its port, with fresh state (empty cache, no faults)."""
        await self.workers[i].stop(kill=True)
        worker = make_worker(self.config, self.host, self._ports[i], i)
        await worker.start()
        self.workers[i] = worker

    async def close(self) -> None:
        for worker in self.workers:
            await worker.stop(kill=True)

    async def __aenter__(self) -> SimulatedFleet:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
