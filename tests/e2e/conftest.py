"""Real-engine fixtures: the tiny model and a fleet of llama.cpp workers, once per session.

The fleet is 4 workers x 2 slots of 4,096 tokens, one compute thread each, host-RAM
prompt cache off: each worker holds exactly 2 prompts. Workers are shared by the whole
session, so every test makes its own prompts (its own seed): nothing another test left
in a slot shares more than the chat template's few leading tokens with them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.engine.llama_fleet import LlamaFleet

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
SLOTS = 2
CTX_PER_SLOT = 4096


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The generated model, cached in the repo's git-ignored ``.cache/``."""
    pytest.importorskip("gguf", reason="needs the engine extra: pip install -e '.[engine]'")
    from loadtests.engine.tiny_model import ensure_tiny_model

    return ensure_tiny_model(REPO_ROOT / ".cache")


@pytest.fixture(scope="session")
def llama_fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaFleet]:
    """The session's workers; their logs are in pytest's temporary directory."""
    pytest.importorskip("xllamacpp", reason="needs the engine extra: pip install -e '.[engine]'")
    log_dir = tmp_path_factory.mktemp("llama-logs")
    with LlamaFleet.start(
        WORKERS, tiny_model, slots=SLOTS, ctx_per_slot=CTX_PER_SLOT, log_dir=log_dir
    ) as fleet:
        yield fleet
