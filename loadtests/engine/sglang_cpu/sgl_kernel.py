"""A pure-torch stand-in for ``sgl_kernel``: the few CPU helpers SGLang 0.5.23 calls.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports names from ``sgl_kernel`` (its kernel
package; the CPU build is compiled from SGLang's source and is not on the registry). On a
CPU without AMX, serving a Llama with ``--attention-backend torch_native --sampling-backend
pytorch`` calls only the two KV-pool helpers below; everything else SGLang might import
at start-up (the speculative-decoding helpers) is defined to raise
:class:`NotImplementedError` when called, and any other name is an ``ImportError``, so a
code path this stand-in does not cover fails loudly instead of computing something wrong.

Installed by :mod:`loadtests.engine.sglang_install` as ``site-packages/sgl_kernel/
__init__.py`` of SGLang's venv; not importable from the project's own venv (no torch).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+prefix-gateway-cpu-stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request→token table.

    For request ``i`` of the batch: ``req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]]`` receives the next ``end_offset[i] - start_offset[i]``
    entries of ``out_cache_loc`` (which holds the batch's slots back to back, in batch
    order). ``pool_len`` is the table's row length (checked, not needed).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token rows are {req_to_token.shape[1]} long, not {pool_len}")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc[j]`` → ``tgt_loc[j]`` in every buffer of the KV pool.

    ``data_ptrs[b]`` is the address of buffer ``b`` (one per layer and K/V), whose rows
    are ``strides[b]`` bytes. All sources are read before any target is written (as the
    kernel's gather-then-scatter), so overlapping moves are safe.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("tgt_loc and src_loc differ in length")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
        table = torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)
        table[tgt] = table[src]


def _not_provided(name: str) -> Any:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the project's CPU stand-in "
            "(loadtests/engine/sglang_cpu/sgl_kernel.py)"
        )

    missing.__name__ = name
    missing.__qualname__ = name
    return missing


# Imported by SGLang's speculative-decoding modules when the CPU engine is on (observed on
# 0.5.23: `from sgl_kernel import ...` at start-up); never called without a draft model.
assign_draft_cache_locs_contiguous_cpu = _not_provided("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_provided("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_provided("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _not_provided("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_provided("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _not_provided("verify_tree_greedy_cpu")
