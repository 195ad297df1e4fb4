"""Prefix index: match, record, capacity bound, correction, forget, idle eviction."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.hashing import block_hashes, seed_for
from gateway.routing.prefix_index import PrefixIndex


def chain(label: str, blocks: int, seed: int = 0) -> list[int]:
    return block_hashes(
        (label * 64)[:64] * 0 + "".join(f"{label}{i:062d}\n" for i in range(blocks)), seed=seed
    )


def test_chain_helper_shapes() -> None:
    assert len(chain("a", 5)) == 5
    assert chain("a", 5)[:3] == chain("a", 3)


def test_match_counts_leading_blocks_per_worker() -> None:
    ix = PrefixIndex()
    a = chain("a", 10)
    ix.record(a, "w1")
    ix.record(a[:4], "w2")
    assert ix.match(a) == {"w1": 10, "w2": 4}
    assert ix.match(a[:2]) == {"w1": 2, "w2": 2}
    assert ix.match(chain("b", 10)) == {}
    assert ix.match([]) == {}
    longer = [*a, 12345]
    assert ix.match(longer) == {"w1": 10, "w2": 4}


def test_shared_prefix_then_divergence() -> None:
    ix = PrefixIndex()
    system = "S" * 64 * 8
    a = block_hashes(system + "A" * 64 * 4)
    b = block_hashes(system + "B" * 64 * 4)
    ix.record(a, "w1")
    assert ix.match(b) == {"w1": 8}


def test_seeds_separate_models_and_salts() -> None:
    ix = PrefixIndex()
    text = "same prompt text " * 40
    ix.record(block_hashes(text, seed=seed_for("m1", None)), "w1")
    assert ix.match(block_hashes(text, seed=seed_for("m1", None))) == {"w1": 10}
    assert ix.match(block_hashes(text, seed=seed_for("m2", None))) == {}
    assert ix.match(block_hashes(text, seed=seed_for("m1", "salt"))) == {}


def test_capacity_evicts_tail_first() -> None:
    ix = PrefixIndex(default_capacity_blocks=10)
    a = chain("a", 8)
    ix.record(a, "w")
    b = chain("b", 5)
    ix.record(b, "w")  # 13 blocks > 10: the three oldest go, deepest first
    assert ix.stats("w").blocks == 10
    assert ix.match(a) == {"w": 5}
    assert ix.match(b) == {"w": 5}


def test_refresh_protects_from_eviction() -> None:
    ix = PrefixIndex(default_capacity_blocks=6)
    a, b = chain("a", 3), chain("b", 3)
    ix.record(a, "w")
    ix.record(b, "w")
    ix.record(a, "w")  # a is now most recent
    ix.record(chain("c", 3), "w")
    assert ix.match(a) == {"w": 3}
    assert ix.match(b) == {}


def test_set_capacity_from_tokens_and_max_blocks() -> None:
    ix = PrefixIndex(block_tokens=16.0, max_blocks_per_worker=1000)
    ix.set_capacity("w", 420_000)
    assert ix.capacity_blocks("w") == 1000  # capped by max_blocks_per_worker
    ix.set_capacity("w", 160)
    assert ix.capacity_blocks("w") == 10
    uncapped = PrefixIndex(block_tokens=16.0)
    uncapped.set_capacity("w", 420_000)
    assert uncapped.capacity_blocks("w") == 26_250
    assert uncapped.capacity_blocks("unknown") == 26_250


def test_shrinking_capacity_evicts_now() -> None:
    ix = PrefixIndex()
    a = chain("a", 20)
    ix.record(a, "w")
    ix.set_capacity("w", 5 * 16)
    assert ix.stats("w").blocks == 5
    assert ix.match(a) == {"w": 5}


def test_forget_worker() -> None:
    ix = PrefixIndex()
    a = chain("a", 6)
    ix.record(a, "w1")
    ix.record(a, "w2")
    ix.forget_worker("w1")
    assert ix.match(a) == {"w2": 6}
    assert ix.workers() == ["w2"]
    assert ix.stats("w1").blocks == 0
    ix.forget_worker("w1")  # idempotent
    ix.record(a[:2], "w3")  # reuses the freed bit without confusion
    assert ix.match(a) == {"w2": 6, "w3": 2}
    ix.forget_worker("w2")
    ix.forget_worker("w3")
    assert ix.match(a) == {}


def test_correct_trims_beyond_real_match_and_counts_fidelity() -> None:
    ix = PrefixIndex(block_tokens=16.0, correction_tolerance=0.0, correction_grace_s=5.0)
    a = chain("a", 10)
    ix.record(a, "w", now=0.0)
    ix.record(a, "w2", now=0.0)
    # long after recording, the worker reports only 3 blocks' worth cached
    ix.correct("w", a, predicted_blocks=10, reported_tokens=3 * 16 + 5, now=100.0)
    assert ix.match(a) == {"w": 3, "w2": 10}
    stats = ix.stats("w")
    assert (stats.predicted_tokens, stats.reported_tokens) == (160, 53)
    assert stats.blocks == 3


def test_correct_keeps_entries_when_report_matches() -> None:
    ix = PrefixIndex(block_tokens=16.0)
    a = chain("a", 10)
    ix.record(a, "w", now=0.0)
    # 10 % under-report is within the default tolerance (tokenizer ratio error)
    ix.correct("w", a, predicted_blocks=10, reported_tokens=144, now=100.0)
    assert ix.match(a) == {"w": 10}


def test_correct_within_grace_does_not_trim() -> None:
    ix = PrefixIndex(block_tokens=16.0, correction_grace_s=5.0)
    a = chain("a", 10)
    ix.record(a, "w", now=0.0)
    ix.record(a, "w", now=1.0)  # a sibling dispatched while the first was in prefill
    ix.correct("w", a, predicted_blocks=10, reported_tokens=0, now=2.0)
    assert ix.match(a) == {"w": 10}
    assert ix.stats("w").predicted_tokens == 160


def test_correct_unknown_worker_is_ignored() -> None:
    ix = PrefixIndex()
    ix.correct("nobody", chain("a", 3), 3, 0)
    assert ix.workers() == []


def test_evict_idle() -> None:
    ix = PrefixIndex()
    old, new = chain("o", 4), chain("n", 4)
    ix.record(old, "w", now=0.0)
    ix.correct("w", old, 0, 4 * 16, now=10.0)  # its response completed at 10 s
    ix.record(new, "w", now=50.0)  # still in flight: pinned, never idle
    assert ix.evict_idle(now=60.0, max_idle_s=0) == 0
    assert ix.evict_idle(now=60.0, max_idle_s=30.0) == 4
    assert ix.match(old) == {}
    assert ix.match(new) == {"w": 4}


def test_stats_bytes_scale_with_blocks() -> None:
    ix = PrefixIndex()
    ix.record(chain("a", 100), "w")
    stats = ix.stats("w")
    assert stats.blocks == 100 and stats.approx_bytes > 100 * 50


def reference_match(held: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for worker, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            out[worker] = n
    return out


def make_ops(kinds: list[str]) -> st.SearchStrategy[list[tuple[str, str, int, int, int]]]:
    return st.lists(
        st.tuples(
            st.sampled_from(kinds),
            st.sampled_from(["w0", "w1", "w2"]),
            st.integers(0, 7),  # which prompt family
            st.integers(1, 30),  # length in blocks
            st.integers(0, 400),  # reported tokens / capacity
        ),
        max_size=60,
    )


def replay(operations: list[tuple[str, str, int, int, int]], exact: bool) -> None:
    ix = PrefixIndex(block_tokens=16.0, default_capacity_blocks=40, correction_grace_s=0.0)
    capacity = {"w0": 40, "w1": 40, "w2": 40}
    # families share prefixes pairwise (0/1, 2/3, ...) up to a family-dependent depth
    families = [
        chain(f"f{k // 2}", 5 + 3 * (k // 2)) + chain(f"g{k}", 25 - 3 * (k // 2)) for k in range(8)
    ]
    for step, (op, worker, family, length, number) in enumerate(operations):
        hashes = families[family][:length]
        if op == "record":
            ix.record(hashes, worker, now=float(step))
        elif op == "correct":
            ix.correct(worker, hashes, length, number, now=float(step) + 1.0)
        elif op == "forget":
            ix.forget_worker(worker)
            capacity[worker] = 40
        else:
            ix.set_capacity(worker, number)
            capacity[worker] = max(1, -(-number // 16))
        held = {w: set(ix._workers[w].lru) | set(ix._workers[w].pins) for w in ix.workers()}
        for w, blocks in held.items():
            assert len(blocks) <= capacity[w]
        # the flat map holds exactly the union of the LRUs
        union: set[int] = set().union(*held.values()) if held else set()
        assert set(ix._holders) == union
        for fam in families:
            got, want = ix.match(fam), reference_match(held, fam)
            if exact:
                assert got == want
            else:  # after corrections: never below the exact answer, never beyond the prompt
                assert set(want) <= set(got)
                assert all(want.get(w, 0) <= n <= len(fam) for w, n in got.items())


@settings(max_examples=50, deadline=None)
@given(make_ops(["record", "record", "record", "forget", "capacity"]))
def test_capacity_bound_and_exact_match_under_random_traffic(
    operations: list[tuple[str, str, int, int, int]],
) -> None:
    replay(operations, exact=True)


@settings(max_examples=50, deadline=None)
@given(make_ops(["record", "record", "correct", "forget", "capacity"]))
def test_capacity_bound_and_match_bounds_with_corrections(
    operations: list[tuple[str, str, int, int, int]],
) -> None:
    replay(operations, exact=False)


def test_grace_applies_where_a_recent_recording_started_adding() -> None:
    ix = PrefixIndex(block_tokens=16.0, correction_tolerance=0.0, correction_grace_s=5.0)
    system = chain("s", 4)
    ix.record(system, "w", now=0.0)  # cached long ago
    first = system + chain("a", 6)
    ix.record(first, "w", now=100.0)  # still in prefill when the sibling arrives
    sibling = system + chain("a", 8)
    ix.record(sibling, "w", now=100.5)
    # the sibling saw only the old system prompt: explained by the first one's prefill
    ix.correct("w", sibling, predicted_blocks=12, reported_tokens=4 * 16, now=101.0)
    assert ix.match(sibling) == {"w": 12}
    ix.correct("w", first, predicted_blocks=4, reported_tokens=4 * 16, now=102.0)
    # the same shortfall long after: the blocks were evicted, trim beyond the real match
    ix.correct("w", sibling, predicted_blocks=12, reported_tokens=4 * 16, now=200.0)
    assert ix.match(sibling) == {"w": 4}
    assert ix.match(system) == {"w": 4}


def test_in_flight_recording_is_pinned_until_its_response_completes() -> None:
    """The engine locks a running request's path: newer prompts beyond capacity evict
    other blocks, not those; on completion the path is touched (most recently used)."""
    ix = PrefixIndex(block_tokens=16.0, default_capacity_blocks=20)
    running = chain("r", 10)
    ix.record(running, "w", now=0.0)  # a long generation, still decoding below
    for i in range(3):
        done = chain(f"d{i}", 10)
        ix.record(done, "w", now=1.0 + i)
        ix.correct("w", done, 0, 10 * 16, now=1.5 + i)
    assert ix.match(running) == {"w": 10}
    assert ix.stats("w").blocks == 20
    ix.correct("w", running, 0, 0, now=10.0)  # completes: unpinned, most recent
    ix.record(chain("n", 10), "w", now=11.0)
    assert ix.match(running) == {"w": 10}
    assert ix.match(chain("d2", 10)) == {}


def test_pins_never_exceed_capacity_and_expire() -> None:
    ix = PrefixIndex(block_tokens=16.0, default_capacity_blocks=20, pin_ttl_s=30.0)
    first, second, third = chain("a", 10), chain("b", 10), chain("c", 10)
    for t, c in enumerate((first, second, third)):
        ix.record(c, "w", now=float(t))  # never completed (e.g. an error, a peer's)
    assert ix.stats("w").blocks == 20  # the oldest recording was released and evicted
    assert ix.match(first) == {}
    ix.record(chain("d", 2), "w", now=100.0)  # b and c expired: plain LRU again
    assert ix.match(second) == {"w": 8} and ix.match(third) == {"w": 10}


def test_release_unpins_a_recording_without_a_report() -> None:
    """A response that reported no cached tokens still ends its recording's pin."""
    index = PrefixIndex(block_tokens=16.0, default_capacity_blocks=100)
    chain = list(range(1, 11))
    index.record(chain, "w", now=0.0)
    state = index._workers["w"]
    assert state.inflight and chain[0] in state.pins
    index.release("w", chain, now=1.0)
    assert not state.inflight and not state.pins
    assert index.match(chain) == {"w": 10}  # still believed held, now evictable


def test_a_recording_without_an_end_is_not_pinned() -> None:
    """A peer gateway's recording: believed held, evictable, holding no block list."""
    index = PrefixIndex(block_tokens=16.0, default_capacity_blocks=100)
    chain = list(range(1, 11))
    index.record(chain, "w", now=0.0, pin=False)
    state = index._workers["w"]
    assert not state.inflight and not state.pins
    assert index.match(chain) == {"w": 10}
    index.record(list(range(100, 195)), "w", now=1.0, pin=False)  # 105 blocks held: over
    assert index.match(chain) == {"w": 5}  # the older chain lost its 5 deepest blocks


def test_in_flight_recordings_are_bounded_per_worker() -> None:
    """Every recording shares its blocks (one hot prompt): pins stay small, but each
    in-flight recording holds a block list, so their number is bounded."""
    from gateway.routing import prefix_index

    index = PrefixIndex(block_tokens=16.0, default_capacity_blocks=100_000)
    for i in range(prefix_index._MAX_INFLIGHT + 50):
        index.record([1, 2, 3, 10_000 + i], "w", now=float(i) * 1e-3)
    state = index._workers["w"]
    assert len(state.inflight) == prefix_index._MAX_INFLIGHT
    assert index.match([1, 2, 3]) == {"w": 3}
