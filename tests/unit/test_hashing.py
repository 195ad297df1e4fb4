"""Chained block hashes: prefix property, partial block, seeds."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.hashing import block_hashes, seed_for


def test_full_blocks_only() -> None:
    assert block_hashes("a" * 63) == []
    assert len(block_hashes("a" * 64)) == 1
    assert len(block_hashes("a" * 200, block_chars=64)) == 3
    assert len(block_hashes("a" * 200, block_chars=10)) == 20


def test_partial_tail_does_not_change_full_blocks() -> None:
    assert block_hashes("x" * 128) == block_hashes("x" * 128 + "tail")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=600), st.text(max_size=300), st.integers(1, 80))
def test_prefix_of_extension(text: str, more: str, block: int) -> None:
    short = block_hashes(text, block)
    long = block_hashes(text + more, block)
    assert long[: len(short)] == short


def test_chain_depends_on_earlier_blocks() -> None:
    a = block_hashes("A" * 64 + "C" * 64)
    b = block_hashes("B" * 64 + "C" * 64)
    assert a[1] != b[1]


def test_chain_depends_on_order() -> None:
    a = block_hashes("A" * 64 + "B" * 64)
    b = block_hashes("B" * 64 + "A" * 64)
    assert a[1] != b[1]
    assert len(set(block_hashes("Z" * 640))) == 10  # equal blocks at different positions


def test_seed_separates_namespaces() -> None:
    text = "shared system prompt " * 20
    plain = block_hashes(text, seed=seed_for("m", None))
    salted = block_hashes(text, seed=seed_for("m", "salt"))
    other_model = block_hashes(text, seed=seed_for("m2", None))
    assert not set(plain) & set(salted)
    assert not set(plain) & set(other_model)
    assert seed_for("m", None) == seed_for("m", "")
    assert seed_for("a", "bc") != seed_for("ab", "c")


def test_str_and_bytes_agree() -> None:
    text = "héllo wörld " * 30
    assert block_hashes(text) == block_hashes(text.encode())


def test_bad_block_size() -> None:
    try:
        block_hashes("abc", 0)
    except ValueError:
        pass
    else:
        raise AssertionError("expected ValueError")
