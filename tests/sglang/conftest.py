"""Real SGLang 0.5.23 on the CPU: its venv, the tiny HF model, and servers per module.

The venv is installed on first use (``loadtests.engine.sglang_install``: a few minutes
once, then reused from ``~/.cache/prefix-gateway/sglang-0.5.23``); the model directory is
written into the repo's git-ignored ``.cache/``. Each test module starts the servers it
needs (at most two at once: about 2.2 GB of RAM each, and idle schedulers poll the CPU)
with a module-scoped fixture, so they stop as soon as the module ends. An install or a
start that fails is an error of the tests, never a skip: these tests exist to say that
the real server works here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import start_fleet

from loadtests.engine.sglang_fleet import SGLangFleet
from loadtests.engine.sglang_install import SGLangEnv, ensure_sglang
from loadtests.engine.sglang_model import ensure_sglang_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/sglang carries the ``sglang`` marker."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session")
def sglang_env() -> SGLangEnv:
    """SGLang's own venv, installed first if missing (see the module docstring)."""
    return ensure_sglang(quiet=True)


@pytest.fixture(scope="session")
def sglang_model(sglang_env: SGLangEnv) -> Path:
    """The tiny random-weights Llama directory (config, safetensors, tokenizer.json)."""
    return ensure_sglang_model(REPO_ROOT / ".cache", sglang_env.python).resolve()


@pytest.fixture(scope="module")
def sglang_pair(
    sglang_env: SGLangEnv, sglang_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangFleet]:
    """Two servers for one module: [0] publishes KV events with ``"bind": true`` (and a
    replay endpoint), [1] with the connect form (``tcp://127.0.0.1:P``, no ``bind``)."""
    log_dir = tmp_path_factory.mktemp("sglang-logs")
    with start_fleet(sglang_env, sglang_model, ["bind", "connect"], log_dir) as fleet:
        yield fleet
