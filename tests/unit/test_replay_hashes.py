"""The replay's trace fast path gives exactly the gateway's own parse of the body."""

from __future__ import annotations

import pytest

from gateway.routing.request import RequestSettings
from loadtests.replay.hashes import TraceHasher, parse_body
from loadtests.workloads import create_workload


@pytest.mark.parametrize("name", ["mooncake", "mooncake-synthetic", "azure"])
def test_trace_hashes_equal_parse_request(name: str) -> None:
    settings = RequestSettings()
    hasher = TraceHasher(settings)
    workload = create_workload(name, ["limit=25"])
    for req in workload.requests:
        fast = hasher.route_request(req)
        slow = parse_body(req, settings, "default")
        assert fast.block_hashes == slow.block_hashes
        assert (fast.prompt_chars, fast.prompt_tokens) == (slow.prompt_chars, slow.prompt_tokens)
        assert hasher.check(req)


def test_shared_first_block_and_model_seed() -> None:
    settings = RequestSettings()
    workload = create_workload("mooncake", ["limit=10"])
    hasher = TraceHasher(settings)
    # Every conversation request starts with block 0: header + 2,048 bytes of it make
    # 32 whole 64-byte blocks in common; block 32 already holds the next trace block.
    a = hasher.route_request(workload.requests[0]).block_hashes
    b = hasher.route_request(workload.requests[1]).block_hashes
    assert a[:32] == b[:32] and a[32] != b[32]
    other = TraceHasher(settings, model="other-model").route_request(workload.requests[0])
    assert other.block_hashes[0] != a[0]
