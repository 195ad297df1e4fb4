"""The slot gate: same-prefix requests on a slot-bound worker wait for the warm slot."""

from __future__ import annotations

import asyncio

import pytest

from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.slot_gate import SlotGate, Ticket

P = tuple(range(100, 120))  # a 20-block shared prefix


def chain(prefix: tuple[int, ...], *tail: int) -> tuple[int, ...]:
    return prefix + tuple(tail)


def slot_index(worker: str = "w", slots: int = 2) -> PrefixIndex:
    index = PrefixIndex(block_tokens=16)
    index.set_capacity(worker, 100_000, max_sequences=slots)
    return index


def send(gate: SlotGate, index: PrefixIndex, *tail: int) -> Ticket:
    """What the router does at dispatch: a place at the gate, then the index records."""
    ticket = gate.enter("w", chain(P, *tail))
    index.record(chain(P, *tail), "w")
    return ticket


async def test_a_sibling_of_a_running_request_waits_and_is_handed_the_slot() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    a = gate.enter("w", chain(P, 1))
    assert a.waiting is None  # nothing runs there: admitted at once
    index.record(chain(P, 1), "w")
    b = gate.enter("w", chain(P, 2))
    assert b.waiting is not None  # its prefix is only in A's busy slot
    index.record(chain(P, 2), "w")
    waiter = asyncio.create_task(gate.wait(b))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    gate.leave(a)
    waited = await asyncio.wait_for(waiter, 1.0)
    assert 0 < waited < 1.0
    assert gate.stats.held == 1 and gate.stats.handed == 1 and gate.stats.timed_out == 0
    gate.leave(b)
    assert gate.waiting("w") == 0


async def test_siblings_are_served_one_after_the_other_oldest_first() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    a = send(gate, index, 1)
    b = send(gate, index, 2)
    c = send(gate, index, 3)  # waits behind B, whose chain is not idle either
    assert b.waiting is not None and c.waiting is not None
    wb, wc = asyncio.create_task(gate.wait(b)), asyncio.create_task(gate.wait(c))
    await asyncio.sleep(0)
    gate.leave(a)
    await asyncio.wait_for(wb, 1.0)
    await asyncio.sleep(0.01)
    assert not wc.done()  # C waits for B's turn
    gate.leave(b)
    await asyncio.wait_for(wc, 1.0)
    gate.leave(c)
    assert gate.stats.handed == 2


async def test_other_prefixes_and_idle_copies_are_never_held() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    a = send(gate, index, 1)
    other = gate.enter("w", tuple(range(500, 520)))
    assert other.waiting is None  # shares nothing with the running request
    gate.leave(other)
    short = gate.enter("w", (P[0], 999, 998, 997, 996, 995, 994, 993, 992, 991, 990, 989))
    assert short.waiting is None  # shares 1 block of 12: below min_share
    gate.leave(short)
    gate.leave(a)
    # the prefix is now idle in a slot: a new request for it goes at once
    b = gate.enter("w", chain(P, 2))
    assert b.waiting is None
    gate.leave(b)


async def test_a_worker_bounded_by_blocks_is_never_held() -> None:
    index = PrefixIndex(block_tokens=16)
    index.set_capacity("w", 100_000)  # an SGLang-like worker: shares prefixes across requests
    gate = SlotGate(index, max_wait_s=5.0)
    a = send(gate, index, 1)
    b = gate.enter("w", chain(P, 2))
    assert a.waiting is None and b.waiting is None
    gate.leave(a)
    gate.leave(b)


async def test_the_wait_is_bounded_then_the_request_goes_ahead() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=0.05)
    a = send(gate, index, 1)
    b = gate.enter("w", chain(P, 2))
    waited = await asyncio.wait_for(gate.wait(b), 1.0)
    assert waited >= 0.04
    assert b.admitted and gate.stats.timed_out == 1
    gate.leave(a)  # nobody is left waiting: nothing to hand on
    assert gate.stats.handed == 0
    gate.leave(b)
    assert gate.waiting("w") == 0


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    a = send(gate, index, 1)
    b = gate.enter("w", chain(P, 2))
    task = asyncio.create_task(gate.wait(b))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.leave(b)  # the router's finally
    assert gate.waiting("w") == 0
    gate.leave(a)
    assert gate.stats.handed == 0


async def test_a_removed_worker_releases_its_waiters() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    send(gate, index, 1)
    b = gate.enter("w", chain(P, 2))
    task = asyncio.create_task(gate.wait(b))
    await asyncio.sleep(0)
    gate.forget_worker("w")
    await asyncio.wait_for(task, 1.0)
    gate.leave(b)


async def test_disabled_gate_holds_nothing() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=0.0)
    send(gate, index, 1)
    assert gate.enter("w", chain(P, 2)).waiting is None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        SlotGate(slot_index(), max_wait_s=-1.0)
    with pytest.raises(ValueError):
        SlotGate(slot_index(), max_wait_s=1.0, min_share=2.0)


async def test_a_calibrated_worker_bounds_the_wait_by_the_prefill_it_saves() -> None:
    index = slot_index()
    # 1 ms per block: the 20 shared blocks would cost 20 ms to recompute; the wait is held
    # to twice that, not the 5 s cap
    gate = SlotGate(index, max_wait_s=5.0, seconds_per_block=lambda w: 1e-3)
    a = send(gate, index, 1)
    b = send(gate, index, 2)
    assert b.max_wait_s == pytest.approx(2 * 20 * 1e-3)
    waited = await asyncio.wait_for(gate.wait(b), 1.0)
    assert waited < 1.0 and gate.stats.timed_out == 1
    gate.leave(a)
    gate.leave(b)
    # uncalibrated (None): the configured cap
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0, seconds_per_block=lambda w: None)
    a = send(gate, index, 1)
    b = send(gate, index, 2)
    assert b.max_wait_s == 5.0
    gate.leave(b)
    gate.leave(a)


async def test_a_request_sharing_only_an_opening_does_not_free_the_slot() -> None:
    index = slot_index()
    gate = SlotGate(index, max_wait_s=5.0)
    a = send(gate, index, 1)  # holds P
    b = send(gate, index, 2)  # waits for A's slot
    assert b.waiting is not None
    other = (P[0], 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910)  # P's first block
    r = gate.enter("w", other)
    assert r.waiting is None  # below min_share of it: never held
    task = asyncio.create_task(gate.wait(b))
    await asyncio.sleep(0)
    gate.leave(r)  # finishes: its slot holds nothing B can use
    await asyncio.sleep(0.01)
    assert not task.done() and gate.stats.handed == 0
    gate.leave(a)
    await asyncio.wait_for(task, 1.0)
    assert gate.stats.handed == 1
    gate.leave(b)
