"""The project's ``sgl_kernel`` stand-in and torchvision patch, inside SGLang's venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loadtests.engine.sglang_fleet import server_env
from loadtests.engine.sglang_install import SGLangEnv

pytestmark = pytest.mark.sglang


def test_the_stand_in_matches_reference_loops(sglang_env: SGLangEnv) -> None:
    script = Path(__file__).with_name("stub_check.py")
    done = subprocess.run(
        [str(sglang_env.python), "-P", str(script)],
        capture_output=True, text=True, timeout=120, env=server_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
