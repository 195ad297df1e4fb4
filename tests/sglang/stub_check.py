"""Run by SGLang's venv interpreter (tests/sglang/test_sglang_cpu_stub.py): checks the
installed ``sgl_kernel`` stand-in against plain reference loops, and the torchvision
patch. Exits non-zero (an AssertionError) on any difference; prints ``ok`` otherwise."""

from __future__ import annotations

import importlib

import torch


def check_assign() -> None:
    import sgl_kernel

    table = torch.zeros((4, 10), dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    starts, ends = torch.tensor([1, 0, 5]), torch.tensor([4, 2, 5])  # the last adds none
    slots = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
    sgl_kernel.assign_req_to_token_pool_cpu(rows, table, starts, ends, slots, 10)
    want = torch.zeros((4, 10), dtype=torch.int32)
    want[2, 1:4] = torch.tensor([11, 12, 13], dtype=torch.int32)
    want[0, 0:2] = torch.tensor([21, 22], dtype=torch.int32)
    assert torch.equal(table, want), table
    try:
        sgl_kernel.assign_req_to_token_pool_cpu(rows, table, starts, ends, slots, 9)
    except ValueError:
        pass
    else:
        raise AssertionError("a wrong row length was accepted")


def check_copy() -> None:
    import sgl_kernel

    k = torch.arange(6 * 8, dtype=torch.bfloat16).reshape(6, 8)  # 16-byte rows
    v = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) * -1  # 12-byte rows
    want_k, want_v = k.clone(), v.clone()
    tgt, src = torch.tensor([1, 4, 5]), torch.tensor([4, 1, 0])  # a swap: reads first
    want_k[tgt] = k[src].clone()
    want_v[tgt] = v[src].clone()
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()])
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])  # nothing


def check_rest() -> None:
    import sgl_kernel

    assert sgl_kernel.__version__.endswith("prefix-gateway-cpu-stub")
    try:
        sgl_kernel.verify_tree_greedy_cpu()
    except NotImplementedError:
        pass
    else:
        raise AssertionError("a speculative helper did not raise")
    try:
        importlib.import_module("sgl_kernel").fused_experts  # noqa: B018
    except AttributeError:
        pass
    else:
        raise AssertionError("an unknown name was provided")
    import torchvision

    assert not torchvision.extension._has_ops()  # the CUDA build's _C cannot load here
    assert torch.__version__.endswith("+cpu")


if __name__ == "__main__":
    check_assign()
    check_copy()
    check_rest()
    print("ok")
