"""The real-SGLang tooling's pure parts, without SGLang: the torchvision patch, the stub's
installation, the install stamp, the server command line, the generated tokenizer, and the
simulator's bind-or-connect rule (the servers themselves are tested in tests/sglang)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.engine import sglang_install as inst
from loadtests.engine.sglang_fleet import CPU_FLAGS, SGLangSettings, server_env
from loadtests.engine.workload import SYLLABLES
from simulator.config import KVEventsConfig

# The shape of torchvision 0.28.0's _meta_registrations.py around what the patch touches.
TV_SOURCE = """import functools

import torch
import torch._custom_ops
import torch.library

# Ensure that torch.ops.torchvision is visible
import torchvision.extension  # noqa: F401


@register_meta("roi_align")
def meta_roi_align(input, rois):
    return input


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
"""


def test_patch_torchvision_makes_both_fake_registrations_conditional(tmp_path: Path) -> None:
    path = tmp_path / "_meta_registrations.py"
    path.write_text(TV_SOURCE)
    assert inst.patch_torchvision(path) is True
    text = path.read_text()
    assert "@torch.library.register_fake(" not in text
    assert text.count('@_register_fake_if_ops("torchvision::') == 2
    helper = text.index("def _register_fake_if_ops")
    assert text.index("import torchvision.extension") < helper < text.index("def meta_nms")
    assert "if torchvision.extension._has_ops():" in text
    compile(text, str(path), "exec")  # still Python
    assert inst.patch_torchvision(path) is False  # idempotent
    assert path.read_text() == text


def test_patch_torchvision_refuses_another_layout(tmp_path: Path) -> None:
    path = tmp_path / "_meta_registrations.py"
    path.write_text("import torch\n")
    with pytest.raises(inst.InstallError, match="layout"):
        inst.patch_torchvision(path)


def test_install_stub_copies_the_stand_in_once(tmp_path: Path) -> None:
    assert inst.install_stub(tmp_path) is True
    target = tmp_path / "sgl_kernel" / "__init__.py"
    source = Path(inst.__file__).parent / "sglang_cpu" / "sgl_kernel.py"
    assert target.read_text() == source.read_text()
    assert inst.install_stub(tmp_path) is False
    target.write_text("stale")
    assert inst.install_stub(tmp_path) is True


def test_the_stamp_names_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = inst.SGLangEnv(tmp_path / "venv")
    assert not env.is_installed()
    env.home.mkdir()
    env.stamp.write_text(inst.recipe_fingerprint() + "\n")
    assert env.is_installed()
    monkeypatch.setattr(inst, "REQUIREMENTS", (*inst.REQUIREMENTS, "extra-package"))
    assert not env.is_installed()  # another recipe: reinstalled


def test_the_recipe_pins_cpu_torch_and_sglang() -> None:
    assert f"torch=={inst.TORCH_VERSION}" in inst.CONSTRAINTS
    assert not any(r.startswith(("torch", "sglang", "sgl-kernel")) for r in inst.REQUIREMENTS)
    assert "transformers==5.19.0" in inst.REQUIREMENTS  # sglang 0.5.23's pin


def test_default_home_is_outside_the_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIX_GATEWAY_SGLANG_HOME", raising=False)
    assert inst.default_home() == Path.home() / ".cache/prefix-gateway/sglang-0.5.23"
    monkeypatch.setenv("PREFIX_GATEWAY_SGLANG_HOME", "/tmp/x")
    assert inst.default_home() == Path("/tmp/x")


def test_server_command_line_and_kv_forms() -> None:
    settings = SGLangSettings(Path("/venv/bin/python"), Path("/m"), 4096, 16, kv_events="bind")
    args = settings.server_args(30000, 5557, 5558)
    for flag in CPU_FLAGS:
        assert flag in args
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--max-total-tokens") + 1] == "4096"
    assert args[args.index("--page-size") + 1] == "16"
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    assert kv == {
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv", "bind": True,
        "replay_endpoint": "tcp://127.0.0.1:5558",
    }  # fmt: skip
    connect = SGLangSettings(Path("p"), Path("m"), kv_events="connect")
    config = connect.kv_events_config(5557, 5558)
    assert config is not None and json.loads(config) == {
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv",
    }  # fmt: skip
    assert "--kv-events-config" not in SGLangSettings(Path("p"), Path("m")).server_args(1, 2, 3)
    with pytest.raises(ValueError):
        SGLangSettings(Path("p"), Path("m"), kv_events="both").kv_events_config(1, 2)
    env = server_env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "PYTHONPATH" not in env


@pytest.mark.parametrize(
    ("config", "binds"),
    [
        ({"endpoint": "tcp://*:5557"}, True),
        ({"endpoint": "tcp://0.0.0.0:5557"}, True),
        ({"endpoint": "tcp://127.0.0.1:*"}, True),
        ({"endpoint": "ipc:///tmp/kv"}, True),
        ({"endpoint": "tcp://127.0.0.1:5557"}, False),
        ({"endpoint": "tcp://127.0.0.1:5557", "bind": True}, True),
        ({"endpoint": "tcp://*:5557", "bind": False}, False),
    ],
)
def test_simulated_publisher_binds_or_connects_as_sglang(
    config: dict[str, object], binds: bool
) -> None:
    parsed = KVEventsConfig.from_json(json.dumps({"publisher": "zmq", **config}))
    assert parsed.binds is binds


def test_the_trained_tokenizer_is_deterministic_and_syllables_are_tokens() -> None:
    pytest.importorskip("tokenizers", reason="needs the exact extra")
    from loadtests.engine.sglang_model import SPECIAL_TOKENS, build_tokenizer

    first, second = build_tokenizer(0), build_tokenizer(0)
    assert first.to_str() == second.to_str()
    assert [first.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = "".join(SYLLABLES[::7])
    assert len(first.encode(text).ids) == len(SYLLABLES[::7])  # one token per syllable
    chatml = "<|im_start|>user\n" + text + "<|im_end|>\n"
    assert first.encode(chatml).ids[0] == 1 and 2 in first.encode(chatml).ids
