"""Install real SGLang 0.5.23 for the CPU in a venv of its own, once, and reuse it.

``pip install sglang==0.5.23`` as published pulls CUDA-only packages and a CUDA build of
``torch==2.14.1``. What runs on a CPU-only machine (``docs/REAL_ENGINE.md``, "Real SGLang
on the CPU"):

1. a new venv (never the project's ``.venv``: SGLang pins versions the gateway does not
   want) with the CPU build of ``torch==2.13.0`` (this machine keeps its wheel in
   ``/opt/wheels``; pip takes it from there);
2. a hand-picked list of SGLang's pure-Python (or CPU-wheel) dependencies,
   :data:`REQUIREMENTS`, installed under the constraint ``torch==2.13.0`` (so nothing
   replaces the CPU torch), then ``sglang==0.5.23`` itself with ``--no-deps``;
3. ``torchvision==0.28.0`` (the release paired with torch 2.13; SGLang imports it at
   start even for text models). The registry's wheel is a CUDA build whose compiled
   extension does not load beside CPU torch, and its ``_meta_registrations`` then fails
   on ``torchvision::nms``; :func:`patch_torchvision` makes those two registrations
   conditional on the extension having loaded, as the others already are;
4. the project's pure-torch stand-in for ``sgl_kernel`` (``sglang_cpu/sgl_kernel.py``),
   copied in as the ``sgl_kernel`` package.

Where: ``$PREFIX_GATEWAY_SGLANG_HOME`` if set, else ``~/.cache/prefix-gateway/
sglang-0.5.23``: outside the clone, so CI (a fresh clone on the same machine) and later
checkouts reuse it. The venv is complete once ``home/.installed`` holds
:func:`recipe_fingerprint`; a changed recipe or an interrupted install starts again from
scratch. Concurrent callers serialise on a lock file beside the venv. Steps 3-4's files
are checked (and rewritten if needed) on every :func:`ensure_sglang`.

The first install downloads about 1.5 GB and takes a few minutes; the venv is about
3 GB (``triton``, which SGLang imports even on the CPU, is a third of it).

CLI::

    python -m loadtests.engine.sglang_install [--home DIR] [--force]   # prints the venv's python
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"
# Bump when the install steps change in a way REQUIREMENTS/CONSTRAINTS do not show.
RECIPE_VERSION = 1
WHEELS_DIR = Path("/opt/wheels")  # this machine's local wheels (torch 2.13.0 CPU)

# SGLang 0.5.23's dependencies that its server imports on the CPU path, at the versions
# it pins where it pins them. Left out on purpose: CUDA/ROCm/NPU kernels (flashinfer,
# sglang-kernel, sgl-deep-*, flash-attn-4, cuda-python, nvidia-*, tilelang, quack),
# audio/video (torchaudio, torchcodec, av), timm, datasets, modelscope, mistral_common,
# py-spy, torch_memory_saver: not imported when serving a text Llama on the CPU.
REQUIREMENTS: tuple[str, ...] = (
    "transformers==5.19.0",
    "tokenizers==0.23.2",
    "xgrammar==0.2.7",  # brings triton, which sglang's KV-pool modules import
    "llguidance>=1.7.6,<2.0.0",
    "outlines==0.1.11",
    "compressed-tensors==0.18.0",
    "openai==2.8.0",
    "openai-harmony==0.0.4",
    "anthropic>=0.20.0",
    "fastapi",
    "uvicorn>=0.51",
    "uvloop",
    "python-multipart",
    "orjson",
    "msgspec",
    "pyzmq>=25.1.2",
    "partial_json_parser",
    "sentencepiece==0.2.1",
    "tiktoken",
    "pybase64",
    "setproctitle",
    "smg-grpc-servicer>=0.9.0",
    "numba==0.65.1",
    "scipy",
    "numpy",
    "pillow",
    "soundfile==0.13.1",
    "aiohttp",
    "requests",
    "tqdm",
    "psutil",
    "packaging",
    "pydantic",
    "python-dateutil<3",
    "prometheus-client>=0.20.0",
    "interegular",
    "einops",
    "easydict",
    "distro",
    "gguf",
    "regex",
    "xxhash",
    "zstandard",
    "watchfiles",
    "blobfile==3.0.0",
    "IPython",  # sglang/utils.py imports IPython.display at import time
    "dill",  # sglang/srt/sampling/custom_logit_processor.py
)
# Applied to every pip call after torch: nothing may replace the CPU torch.
CONSTRAINTS: tuple[str, ...] = (f"torch=={TORCH_VERSION}", "apache-tvm-ffi==0.1.11")

_STUB_SOURCE = Path(__file__).resolve().parent / "sglang_cpu" / "sgl_kernel.py"
_TV_MARK = "# prefix-gateway: registrations skipped when torchvision's _C did not load"
_TV_ANCHOR = "import torchvision.extension  # noqa: F401\n"
_TV_HELPER = f"""

{_TV_MARK}
def _register_fake_if_ops(qualname):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(qualname)
    return lambda fn: fn
"""
_TV_DECORATOR = '@torch.library.register_fake("torchvision::'


def default_home() -> Path:
    """``$PREFIX_GATEWAY_SGLANG_HOME``, else ``~/.cache/prefix-gateway/sglang-<version>``."""
    env = os.environ.get("PREFIX_GATEWAY_SGLANG_HOME")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "prefix-gateway" / f"sglang-{SGLANG_VERSION}"


def recipe_fingerprint() -> str:
    """What an installed venv must have been built from (versions and package lists)."""
    parts = (str(RECIPE_VERSION), SGLANG_VERSION, TORCH_VERSION, TORCHVISION_VERSION)
    text = "\n".join((*parts, *REQUIREMENTS, *CONSTRAINTS))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SGLangEnv:
    """An installed SGLang venv."""

    home: Path

    @property
    def python(self) -> Path:
        return self.home / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return self.home / "lib" / version / "site-packages"

    @property
    def stamp(self) -> Path:
        return self.home / ".installed"

    def is_installed(self) -> bool:
        """True when the stamp matches this recipe (the pip steps are done)."""
        try:
            return self.stamp.read_text().strip() == recipe_fingerprint()
        except OSError:
            return False


class InstallError(RuntimeError):
    """A step of the install failed; the message holds the tail of its log."""


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_sglang(
    home: Path | None = None, *, force: bool = False, quiet: bool = False
) -> SGLangEnv:
    """Return the SGLang venv at ``home`` (default :func:`default_home`), installing it
    first if it is missing or built from another recipe (or ``force``).

    Raises :class:`InstallError` naming the step that failed. Safe to call concurrently
    (a lock file beside the venv); a half-built venv is never stamped, so the next call
    rebuilds it.
    """
    env = SGLangEnv(home or default_home())
    with _locked(env.home.parent / f".{env.home.name}.lock"):
        if force or not env.is_installed():
            _install(env, quiet=quiet)
        patch_torchvision(env.site_packages / "torchvision" / "_meta_registrations.py")
        install_stub(env.site_packages)
    return env


def _install(env: SGLangEnv, *, quiet: bool) -> None:
    started = time.monotonic()
    if env.home.exists():
        shutil.rmtree(env.home)
    env.home.parent.mkdir(parents=True, exist_ok=True)
    log = env.home.parent / f"{env.home.name}-install.log"
    log.write_text("")

    def say(message: str) -> None:
        if not quiet:
            print(f"[sglang-install {time.monotonic() - started:5.0f}s] {message}", flush=True)

    say(f"creating venv {env.home} (log: {log})")
    _run([sys.executable, "-m", "venv", str(env.home)], log, "venv")
    pip = [str(env.python), "-m", "pip", "install", "--disable-pip-version-check"]
    if WHEELS_DIR.is_dir():
        pip += ["--find-links", str(WHEELS_DIR)]
    say(f"torch=={TORCH_VERSION} (CPU)")
    _run([*pip, f"torch=={TORCH_VERSION}"], log, "torch")
    _check_cpu_torch(env, log)
    constraints = env.home / "constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    say(f"{len(REQUIREMENTS)} dependencies under {', '.join(CONSTRAINTS)}")
    _run([*pip, "-c", str(constraints), *REQUIREMENTS], log, "dependencies")
    say(f"sglang=={SGLANG_VERSION} --no-deps, torchvision=={TORCHVISION_VERSION}")
    _run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], log, "sglang")
    _run([*pip, "-c", str(constraints), f"torchvision=={TORCHVISION_VERSION}"], log, "torchvision")
    _check_cpu_torch(env, log)
    patch_torchvision(env.site_packages / "torchvision" / "_meta_registrations.py")
    install_stub(env.site_packages)
    _run(
        [str(env.python), "-c", "import torchvision, sgl_kernel, sglang.srt.server_args"],
        log,
        "import check",
    )
    env.stamp.write_text(recipe_fingerprint() + "\n")
    say(f"done in {time.monotonic() - started:.0f} s")


def _check_cpu_torch(env: SGLangEnv, log: Path) -> None:
    out = subprocess.run(
        [str(env.python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if not out.stdout.strip().startswith(f"{TORCH_VERSION}+cpu"):
        raise InstallError(
            f"expected torch {TORCH_VERSION}+cpu in {env.home}, found "
            f"{out.stdout.strip() or out.stderr.strip()[-500:]!r} (log: {log})"
        )


def _run(args: Sequence[str], log: Path, step: str) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(list(args), stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise InstallError(f"sglang install: step {step!r} failed ({proc.returncode}):\n{tail}")


def patch_torchvision(path: Path) -> bool:
    """Make torchvision's unconditional ``register_fake("torchvision::nms"/"qnms")``
    conditional on its compiled extension having loaded (the other registrations in the
    file already are). Idempotent; returns True when the file was changed. Raises
    :class:`InstallError` if the file does not look as expected (another release)."""
    text = path.read_text()
    if _TV_MARK in text:
        return False
    if _TV_ANCHOR not in text or _TV_DECORATOR not in text:
        raise InstallError(f"{path}: not the torchvision {TORCHVISION_VERSION} layout expected")
    text = text.replace(_TV_ANCHOR, _TV_ANCHOR + _TV_HELPER, 1)
    text = text.replace(_TV_DECORATOR, '@_register_fake_if_ops("torchvision::')
    path.write_text(text)
    return True


def install_stub(site_packages: Path) -> bool:
    """Copy the project's ``sgl_kernel`` stand-in in as ``site_packages/sgl_kernel``
    (rewritten only when it differs); returns True when it was written."""
    target = site_packages / "sgl_kernel" / "__init__.py"
    source = _STUB_SOURCE.read_text()
    if target.exists() and target.read_text() == source:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: install (or check) the venv and print its python's path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--home", type=Path, default=None, help="venv directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if installed")
    args = parser.parse_args(argv)
    try:
        env = ensure_sglang(args.home, force=args.force)
    except InstallError as exc:
        sys.exit(str(exc))
    print(env.python)


if __name__ == "__main__":
    main()
