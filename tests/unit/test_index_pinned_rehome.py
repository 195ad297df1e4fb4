"""A recording without an end (``record(..., pin=False)``: a re-homing's, a peer's) over
blocks an in-flight recording pins (issue 20: in the multi-turn drain replay the
re-homing's recordings of the shared system prompt on busy homes made every home lose
it from the index for good, 16,267 of 17,000 decisions in the window a miss)."""

from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.rehome import ChainLog, RehomeSettings, plan_rehome

SYSTEM = list(range(10**9, 10**9 + 10))  # a system prompt every conversation shares


def _conversation(tag: int, n: int = 10) -> list[int]:
    return [*SYSTEM, *(tag * 1000 + i for i in range(n))]


def _serve(index: PrefixIndex, chain: list[int], t: float) -> None:
    """One request dispatched and completed (its report: the whole prompt cached)."""
    index.record(chain, "w", now=t)
    index.correct("w", chain, len(chain), len(chain) * 16, now=t + 0.5)


def test_an_unpinned_recording_leaves_an_in_flight_prefix_pinned() -> None:
    index = PrefixIndex(block_tokens=16.0, default_capacity_blocks=60)
    running = _conversation(1)
    index.record(running, "w", now=0.0)  # in flight: the system prompt pinned
    index.record(_conversation(2), "w", now=1.0, pin=False)  # re-homed onto w
    state = index._workers["w"]
    assert not set(state.pins) & set(state.lru)  # a block is pinned or in the LRU
    for i in range(3, 12):  # more conversations than the capacity holds
        _serve(index, _conversation(i), 2.0 + i)
    assert index.match(SYSTEM) == {"w": 10}  # still believed held (the engine holds it)
    index.correct("w", running, len(running), len(running) * 16, now=20.0)
    for i in range(12, 20):
        _serve(index, _conversation(i), 20.0 + i)
    assert index.match(_conversation(30)) == {"w": 10}


def test_rehoming_onto_a_busy_home_keeps_its_shared_prompt_matched() -> None:
    index = PrefixIndex(block_tokens=16.0)
    for w in ("drained", "w"):
        index.set_capacity(w, 60 * 16)
    log: ChainLog[bytes] = ChainLog(index.capacity_blocks)
    for i in range(1, 4):  # conversations on the drained worker, used twice
        chain = _conversation(i)
        for t in (1.0, 2.0):
            index.record(chain, "drained", now=t, pin=False)
            log.record("drained", chain, len(chain) * 16, t)
    index.record(_conversation(9), "w", now=3.0)  # w busy: a request in flight
    report, _ = plan_rehome(log, index, ["drained"], {"w": 0.0}, 4.0,
                            RehomeSettings(min_uses=1))  # fmt: skip
    assert report.rehomed == 3
    index.forget_worker("drained")
    for i in range(10, 30):  # traffic turns w's cache over while the request runs
        _serve(index, _conversation(i), 5.0 + i)
    assert index.match(_conversation(99)) == {"w": 10}
