"""What a worker model reads of a worker's configuration, as a protocol.

:meth:`simulator.model.radix_worker.WorkerModel.from_config` and
:meth:`simulator.model.slots.SlotWorkerModel.from_config` take any object with these
attributes; the simulator passes its :class:`simulator.config.SimConfig`. The models do not
import that class: the configuration builds on the models (it resolves their profiles), and
an import running both ways would be a cycle.
"""

from __future__ import annotations

from typing import Protocol

from simulator.model.hicache import HiCacheSettings
from simulator.model.profiles import Profile


class WorkerSettings(Protocol):
    """The configuration a model is built from (read-only here)."""

    @property
    def capacity_tokens(self) -> int | None: ...  # None: the profile's
    @property
    def context_length(self) -> int | None: ...  # None: the profile's
    @property
    def page_size(self) -> int: ...
    @property
    def max_running_requests(self) -> int | None: ...  # None: SGLang's formula
    @property
    def schedule_policy(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def slots(self) -> int: ...  # llama.cpp's n_parallel
    @property
    def lora_enabled(self) -> bool: ...  # SGLang's --enable-lora (or --lora-paths given)
    @property
    def max_loras_per_batch(self) -> int: ...
    def resolved_profile(self) -> Profile: ...
    def resolved_hicache(self) -> HiCacheSettings | None: ...  # None: no host tier
