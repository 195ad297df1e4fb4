"""What tests and benchmarks share to run things (never imported by the gateway).

- ``ports``: free loopback ports and port ranges.
- ``procs``: start a process, wait until it is ready, stop it by PID; /proc usage.
- ``stats``: percentiles, each caller naming its definition.
- ``inprocess``: the real gateway app in this process (``run_gateway``,
  ``BackgroundGateway``) and the simulated worker's control API.
- ``gateway_proc``: the gateway or sglang-router as a subprocess (``run_gateway``).
- ``sim_fleet``: ``python -m simulator`` as a subprocess (``run_sim_fleet``).
- ``redis``: a private ``redis-server`` and shared-state key helpers.
"""
