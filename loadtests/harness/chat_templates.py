"""Real models' chat templates for the oracle tests, fetched from the package registry.

The project commits no fetched material, so the templates are obtained at test time: the
source distribution of ``llama-cpp-python`` 0.3.36 on PyPI vendors llama.cpp's
``models/templates/*.jinja``, 70 chat templates copied from the models' own repositories
(Llama 3.1/3.2/3.3, Qwen2.5/QwQ/Qwen3, DeepSeek R1/V3.x, Mistral, Granite, Hermes tool
use, Gemma, Phi, Command-R, functionary, ...). :func:`chat_templates_dir` downloads the
archive once with pip's ordinary client (``pip download --no-deps --no-binary :all:``),
checks its SHA-256 against the pinned one, extracts only ``*.jinja`` (and the README
naming their sources) into a directory that appears atomically (built beside it, then
renamed), and removes the archive. Later calls return the directory at once.

Cache: ``~/.cache/prefix-gateway/chat-templates/`` unless ``PREFIX_GATEWAY_CHAT_TEMPLATES``
names another directory. A failed download (registry unreachable, wrong hash) raises
:class:`TemplatesUnavailable`; tests skip on it only when nothing is cached.

CLI: ``python -m loadtests.harness.chat_templates`` prints the directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
CACHE_ENV = "PREFIX_GATEWAY_CHAT_TEMPLATES"
DEFAULT_CACHE = Path.home() / ".cache" / "prefix-gateway" / "chat-templates"
DOWNLOAD_TIMEOUT_S = 600.0


class TemplatesUnavailable(RuntimeError):
    """The templates are not cached and could not be fetched."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def chat_templates_dir(root: Path | None = None) -> Path:
    """The directory of the 70 ``*.jinja`` templates, fetched and extracted on first use."""
    root = root or cache_root()
    target = root / "llama-cpp-python-0.3.36-templates"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        archive = _download(Path(tmp))
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".templates-"))
        try:
            _extract(archive, staging)
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not a concurrent builder's win: a real failure
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _download(into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--no-binary", ":all:", SDIST, "--dest", str(into),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise TemplatesUnavailable(f"pip download {SDIST}: timed out") from None
    archive = into / SDIST_FILE
    if done.returncode != 0 or not archive.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise TemplatesUnavailable(f"pip download {SDIST} failed: {' | '.join(tail)}")
    digest = _sha256(archive)
    if digest != SDIST_SHA256:
        raise TemplatesUnavailable(f"{SDIST_FILE}: sha256 {digest}, expected {SDIST_SHA256}")
    return archive


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract(archive: Path, into: Path) -> None:
    """Copy the templates' bytes out by name (no member is extracted as a path)."""
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            name = member.name.removeprefix(MEMBER_DIR)
            if (
                member.name == name
                or "/" in name
                or not member.isfile()
                or not (name.endswith(".jinja") or name == "README.md")
            ):
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            with source:
                (into / name).write_bytes(source.read())
            count += name.endswith(".jinja")
    if count == 0:
        raise TemplatesUnavailable(f"{SDIST_FILE}: no templates under {MEMBER_DIR}")


if __name__ == "__main__":
    print(chat_templates_dir())
