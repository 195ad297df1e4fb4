"""The prefill gate: on a radix-cache worker, a sibling of a request in prefill waits for
that request's first byte (its prompt then cached), bounded, in order."""

from __future__ import annotations

import asyncio

import pytest

from gateway.routing.prefill_gate import PrefillGate

P = tuple(range(100, 120))  # a 20-block prompt prefix
Q = tuple(range(200, 210))  # 10 more blocks two later requests share


class Index:
    """The prefix index's answer the gate reads: None = bounded by blocks (radix)."""

    def __init__(self, slots: list[tuple[int, ...]] | None = None) -> None:
        self.slots = slots

    def held_sequences(self, worker_id: str) -> list[tuple[int, ...]] | None:
        return self.slots


def gate(max_wait_s: float = 5.0, per_block: float | None = None) -> PrefillGate:
    def prefill_s(worker_id: str, blocks: int) -> float | None:
        return None if per_block is None else per_block * blocks

    return PrefillGate(Index(), max_wait_s, prefill_s=prefill_s)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_siblings_wait_for_the_first_ones_first_byte_then_all_go() -> None:
    g = gate()
    first = g.enter("w", P, 0)  # nothing held, nothing in prefill: goes at once
    assert first.waiting is None
    # the index recorded the first at dispatch: its match counts those 20 blocks
    siblings = [g.enter("w", P, len(P)) for _ in range(7)]
    assert all(s.waiting is not None for s in siblings)
    tasks = [asyncio.create_task(g.wait(s)) for s in siblings]
    await settle()
    assert not any(t.done() for t in tasks) and g.waiting("w") == 7
    g.first_byte(first)
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert g.waiting("w") == 0 and g.in_prefill("w") == 7
    assert (g.stats.held, g.stats.handed, g.stats.timed_out) == (7, 7, 0)
    for s in siblings:
        g.first_byte(s)
        g.leave(s)
    g.leave(first)
    assert g.in_prefill("w") == 0


async def test_requests_sharing_nothing_or_what_is_held_are_never_held() -> None:
    g = gate()
    g.enter("w", P, 0)
    assert g.enter("w", tuple(range(900, 920)), 0).waiting is None  # shares nothing
    assert g.enter("x", P, 0).waiting is None  # another worker
    held_before = gate()
    held_before.enter("w", (*P, 1), len(P))  # the worker held the prefix before
    assert held_before.enter("w", (*P, 2), len(P)).waiting is None
    assert held_before.stats.held == 0


async def test_a_share_below_min_share_is_not_held() -> None:
    g = gate()
    long = P + tuple(range(300, 500))  # 220 blocks, 20 of them shared: < 10 %
    g.enter("w", P, 0)
    assert g.enter("w", long, len(P)).waiting is None


async def test_slot_bound_workers_and_a_zero_bound_are_never_held() -> None:
    slots = PrefillGate(Index([P]), 5.0)
    slots.enter("w", P, 0)
    assert slots.enter("w", P, len(P)).waiting is None
    off = gate(max_wait_s=0.0)
    off.enter("w", P, 0)
    assert off.enter("w", P, len(P)).waiting is None


async def test_a_waiter_sharing_more_with_another_waits_for_that_one() -> None:
    g = gate()
    lead = g.enter("w", (*P, 1), 0)
    a = g.enter("w", P + Q + (2,), len(P))
    b = g.enter("w", P + Q + (3,), len(P))
    ta, tb = asyncio.create_task(g.wait(a)), asyncio.create_task(g.wait(b))
    g.first_byte(lead)  # P is cached now; A goes, B shares Q with A beyond it
    await asyncio.wait_for(ta, 1.0)
    await settle()
    assert not tb.done() and g.waiting("w") == 1
    g.first_byte(a)
    await asyncio.wait_for(tb, 1.0)
    assert g.stats.handed == 2


async def test_a_failed_leader_releases_the_oldest_waiter_which_leads() -> None:
    g = gate()
    lead = g.enter("w", P, 0)
    waiters = [g.enter("w", P, len(P)) for _ in range(3)]
    tasks = [asyncio.create_task(g.wait(w)) for w in waiters]
    g.leave(lead)  # ended without a first byte: nothing cached
    await asyncio.wait_for(tasks[0], 1.0)
    await settle()
    assert not tasks[1].done() and not tasks[2].done()  # the new leader's siblings
    g.first_byte(waiters[0])
    await asyncio.wait_for(asyncio.gather(*tasks[1:]), 1.0)
    assert g.stats.timed_out == 0


async def test_a_client_gone_while_held_is_removed_at_once() -> None:
    g = gate()
    lead = g.enter("w", P, 0)
    gone, stays = g.enter("w", P, len(P)), g.enter("w", P, len(P))
    t_gone, t_stays = asyncio.create_task(g.wait(gone)), asyncio.create_task(g.wait(stays))
    await settle()
    t_gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t_gone
    g.leave(gone)  # the router's finally
    assert g.waiting("w") == 1
    g.first_byte(lead)
    await asyncio.wait_for(t_stays, 1.0)
    assert g.stats.handed == 1


async def test_the_bound_lets_a_waiter_go_and_it_then_counts_as_in_prefill() -> None:
    g = gate(max_wait_s=0.01)
    g.enter("w", P, 0)
    late = g.enter("w", P, len(P))
    await g.wait(late)
    assert g.stats.timed_out == 1 and g.waiting("w") == 0 and g.in_prefill("w") == 2


async def test_the_bound_is_the_prefill_it_saves_once_calibrated() -> None:
    g = gate(max_wait_s=5.0, per_block=0.001)
    g.enter("w", P, 5)  # 5 of its 20 blocks held before: 15 saved
    sibling = g.enter("w", P, len(P))
    assert sibling.held == 5  # the match's 20 blocks were mostly the first's, in prefill
    assert sibling.max_wait_s == pytest.approx(0.015)
    g.forget_worker("w")


async def test_a_forgotten_worker_releases_its_waiters() -> None:
    g = gate()
    g.enter("w", P, 0)
    w = g.enter("w", P, len(P))
    task = asyncio.create_task(g.wait(w))
    await settle()
    g.forget_worker("w")
    await asyncio.wait_for(task, 1.0)
    g.leave(w)
    assert g.waiting("w") == 0 and g.in_prefill("w") == 0


async def test_siblings_of_a_waiting_request_wait_behind_it() -> None:
    """Requests waiting count as sharers: the index already counts a waiting request's
    blocks (recorded at its dispatch) as held, yet its siblings wait behind it."""
    g = gate()
    lead = g.enter("w", P, 0)
    first = g.enter("w", P + Q, len(P))  # P: the lead's, in prefill
    sibling = g.enter("w", P + Q, len(P + Q))  # the whole prompt: the first's, waiting
    assert first.waiting is not None and sibling.waiting is not None
    t_first, t_sibling = asyncio.create_task(g.wait(first)), asyncio.create_task(g.wait(sibling))
    g.first_byte(lead)  # P is cached: the first goes, then leads
    await asyncio.wait_for(t_first, 1.0)
    await settle()
    assert not t_sibling.done()
    g.first_byte(first)
    await asyncio.wait_for(t_sibling, 1.0)
    assert g.stats.timed_out == 0


async def test_a_small_share_of_what_the_sharer_computes_is_not_worth_its_prefill() -> None:
    """Groups sharing an instruction: the second group's first shares 5 of the 20 blocks
    the first group's computes; it goes at once (waiting would cost that whole prefill to
    save a quarter of it), and its siblings wait for it."""
    g = gate()
    instruction = P[:5]
    g.enter("w", instruction + tuple(range(1, 16)), 0)
    group = instruction + tuple(range(31, 46))
    first = g.enter("w", group, len(instruction))
    assert first.waiting is None
    assert g.enter("w", group, len(group)).waiting is not None
    assert g.stats.held == 1
    g.forget_worker("w")


async def test_a_sibling_goes_at_once_behind_more_than_one_prefill_batch() -> None:
    """Sent now, it would be prefilled in a later batch than its sibling, after that one
    is cached: a hit without waiting. Held, it would go behind the queue afterwards."""
    g = PrefillGate(Index(), 5.0, batch_blocks=lambda worker_id: 30)
    g.enter("w", P, 0)  # 20 blocks to prefill: within a batch
    assert g.enter("w", P, len(P)).waiting is not None
    g.enter("w", tuple(range(900, 915)), 0)  # 15 more: 35 queued, over the batch
    assert g.enter("w", P, len(P)).waiting is None
    g.forget_worker("w")


async def test_waiters_go_at_a_release_once_the_queue_is_over_a_batch() -> None:
    g = PrefillGate(Index(), 5.0, batch_blocks=lambda worker_id: 30)
    lead = g.enter("w", (*P, 7), 0)  # 21 blocks: within a batch
    other = g.enter("w", P + Q, len(P))  # shares P with the lead: waits
    sibling = g.enter("w", (*P, *Q, 8), len(P + Q))  # shares P + Q with it: waits behind
    assert other.waiting is not None and sibling.waiting is not None
    tasks = [asyncio.create_task(g.wait(w)) for w in (other, sibling)]
    await settle()
    g.enter("w", tuple(range(900, 925)), 0)  # 25 blocks arrive: over a batch with Q's 10
    g.first_byte(lead)  # P is cached; the other goes and, the queue deep, its sibling too
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert g.stats.handed == 2 and g.stats.timed_out == 0
    g.forget_worker("w")


async def test_waiters_stay_at_a_release_while_the_queue_is_within_a_batch() -> None:
    g = PrefillGate(Index(), 5.0, batch_blocks=lambda worker_id: 30)
    lead = g.enter("w", (*P, 7), 0)
    other = g.enter("w", P + Q, len(P))
    sibling = g.enter("w", (*P, *Q, 8), len(P + Q))
    tasks = [asyncio.create_task(g.wait(w)) for w in (other, sibling)]
    await settle()
    g.enter("w", tuple(range(900, 915)), 0)  # 15 blocks: 25 queued with Q's 10
    g.first_byte(lead)
    await asyncio.wait_for(tasks[0], 1.0)
    await settle()
    assert not tasks[1].done()  # it waits for the other's first byte
    g.forget_worker("w")
    await asyncio.wait_for(tasks[1], 1.0)


async def test_the_queue_shrinks_at_first_bytes_and_siblings_are_held_again() -> None:
    g = PrefillGate(Index(), 5.0, batch_blocks=lambda worker_id: 30)
    other = g.enter("w", tuple(range(900, 920)), 0)  # 20 blocks
    g.enter("w", P, 0)  # 40 queued: over a batch
    assert g.enter("w", P, len(P)).waiting is None  # prefilled after P's first: a hit
    g.first_byte(other)  # 20 queued (P) + 0 (its sibling, P held now)
    assert g.enter("w", P, len(P)).waiting is not None
    g.forget_worker("w")
