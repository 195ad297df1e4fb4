"""Deferred recording (``PrefixIndex.defer``, issue 22 "Scale"): the recording's
bookkeeping waits for ``flush``; a match right after it already co-locates; every other
public method sees the index as if nothing had been deferred; after a flush the index is
the one recording at once would have left, whatever the operations in between."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app import _soon
from gateway.routing import prefix_index
from gateway.routing.prefix_index import PrefixIndex


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Conversations on a few shared roots: each a root then its own turns."""
    roots = [[hash(("root", r, i)) for i in range(rng.randint(1, 6))] for r in range(3)]
    out = []
    for c in range(n):
        root = roots[c % 3]
        out.append([*root, *(hash(("turn", c, i)) for i in range(rng.randint(0, 12)))])
    return out


def _snapshot(ix: PrefixIndex, workers: list[str]) -> list[object]:
    return [(w, ix.blocks(w), ix.stats(w), ix.tiers(w)) for w in workers]


def _books(ix: PrefixIndex) -> dict[str, object]:
    """Every worker's bookkeeping as it stands (no flush): LRU and pins with their order,
    in-flight recordings, insertion points, and the holder bits."""
    books: dict[str, object] = {
        w: (
            list(s.lru.items()),
            list(s.pins.items()),
            list(s.host.items()),
            [(list(chain), t) for chain, t in s.inflight.values()],
            list(s.fresh.items()),
        )
        for w, s in ix._workers.items()
    }
    books["holders"] = {h: ix._names[bit] for h, bit in ix._holders.items() if bit in ix._names}
    return books


def _pair(capacity: int) -> tuple[PrefixIndex, PrefixIndex, list[int]]:
    scheduled: list[int] = []
    now_ix = PrefixIndex(default_capacity_blocks=capacity, clock=lambda: 0.0)
    later = PrefixIndex(default_capacity_blocks=capacity, clock=lambda: 0.0)
    later.defer(lambda: scheduled.append(1))
    return now_ix, later, scheduled


def test_record_is_deferred_but_the_next_match_co_locates() -> None:
    _, ix, scheduled = _pair(100)
    held = [hash(("h", i)) for i in range(8)]
    ix.record(held, "w1", now=1.0)
    ix.flush()
    scheduled.clear()
    longer = [*held, *(hash(("n", i)) for i in range(5))]
    ix.record(longer, "w1", now=2.0)
    ix.record(longer[:3], "w2", now=2.0)
    assert scheduled == [1]  # asked once for the batch
    assert ix.match(longer) == {"w1": 13, "w2": 3}  # before any flush
    assert ix._pending  # the bookkeeping still waits
    assert ix.stats("w1").blocks == 13  # a public read flushes first
    assert not ix._pending


def test_flush_leaves_what_recording_at_once_leaves() -> None:
    at_once, deferred, _ = _pair(20)
    rng = random.Random(5)
    chains = _chains(rng, 40)
    for i, c in enumerate(chains):
        w = f"w{rng.randrange(3)}"
        for ix in (at_once, deferred):
            ix.record(c, w, now=float(i))
    deferred.flush()
    assert _books(deferred) == _books(at_once)
    for held in chains:
        assert deferred.match(held) == at_once.match(held)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "peer", "correct", "release", "forget", "idle", "flush"]),
            st.integers(0, 5),  # chain (few: operations meet on the same ones)
            st.integers(0, 2),  # worker
            st.integers(0, 12),  # reported blocks (correct)
        ),
        max_size=60,
    ),
    capacity=st.integers(3, 40),
)
def test_any_operations_see_the_same_index(
    ops: list[tuple[str, int, int, int]], capacity: int
) -> None:
    """Interleaved with every other operation, deferred recordings change nothing that
    any read but ``match`` can see, and after a flush not even ``match``."""
    at_once, deferred, _ = _pair(capacity)
    chains = _chains(random.Random(capacity), 6)
    workers = ["w0", "w1", "w2"]
    for t, (op, c, w, reported) in enumerate(ops):
        chain, wid, now = chains[c], workers[w], float(t)
        for ix in (at_once, deferred):
            if op == "record":
                ix.record(chain, wid, now)
            elif op == "peer":
                ix.record(chain, wid, now, pin=False)
            elif op == "correct":
                ix.correct(wid, chain, len(chain), reported * 16, now)
            elif op == "release":
                ix.release(wid, chain, now)
            elif op == "forget":
                ix.forget_worker(wid)
            elif op == "idle":
                ix.evict_idle(now, 5.0)
            elif op == "flush":
                ix.flush()
        if op != "record":  # every other operation flushed first
            assert not deferred._pending
            assert _books(deferred) == _books(at_once)
            assert _snapshot(deferred, workers) == _snapshot(at_once, workers)
    deferred.flush()
    assert _books(deferred) == _books(at_once)
    for held in chains:
        assert deferred.match(held) == at_once.match(held)


def test_waiting_recordings_are_bounded(monkeypatch: object) -> None:
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setattr(prefix_index, "_MAX_PENDING", 3)
    try:
        at_once, deferred, scheduled = _pair(50)
        chains = _chains(random.Random(2), 10)
        for i, c in enumerate(chains):
            for ix in (at_once, deferred):
                ix.record(c, "w0", now=float(i))
        assert len(deferred._pending) == 3  # the oldest were done at once
        assert scheduled == [1]
        assert _snapshot(deferred, ["w0"]) == _snapshot(at_once, ["w0"])
    finally:
        mp.undo()


def test_sequence_bound_workers_and_undeferring_record_at_once() -> None:
    _, ix, scheduled = _pair(50)
    ix.set_capacity("slots", 800, max_sequences=2)
    a = [hash(("a", i)) for i in range(4)]
    ix.record(a, "slots", now=1.0)
    assert not ix._pending and not scheduled
    assert ix.held_sequences("slots") == [tuple(a)]
    ix.record(a, "w", now=1.0)
    assert ix._pending
    ix.defer(None)  # flushes, then records at once
    assert not ix._pending
    ix.record([*a, 7], "w", now=2.0)
    assert not ix._pending and scheduled == [1]


def test_the_gateways_schedule_flushes_on_the_loops_next_turn() -> None:
    ix = PrefixIndex(clock=lambda: 0.0)
    ix.defer(_soon(ix.flush))
    a = [hash(("a", i)) for i in range(6)]
    ix.record(a, "w", now=1.0)  # no running loop: at once
    assert not ix._pending

    async def dispatch() -> None:
        ix.record([*a, 1, 2], "w", now=2.0)
        assert ix._pending  # on the request's path: only the marks
        await asyncio.sleep(0)
        assert not ix._pending  # the loop's next turn did the rest

    asyncio.run(dispatch())
    assert ix.stats("w").blocks == 8
