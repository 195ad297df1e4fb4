"""Exact mode's feeds: one ZMQ SUB per (worker, DP rank), with gap replay and restarts.

:class:`RankFeed` follows one rank's live stream and checks its sequence numbers:

* on start, if the descriptor has a replay endpoint, it first asks it for everything from
  seq 0, so a gateway that starts after the worker still learns its history (as far as
  the buffer goes);
* a jump asks the replay endpoint for the missing batches; a gap replay cannot fill (no
  endpoint, timeout, buffer already past it) calls ``on_gap_lost`` (the manager clears
  the rank and marks the worker degraded for ``stale_timeout_s``);
* a sequence that does not go forward means the worker restarted: ``on_reset`` (the
  manager clears the rank), then a catch-up from seq 0 through the replay endpoint.

Each decoded batch goes to ``apply(rank, ts, events)``; an undecodable one is logged and
skipped. Cost: one msgpack decode per batch; a replay is one DEALER round trip, bounded by
``replay_timeout_s``. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from gateway.exact.wire import END_SEQ, SEQ, Descriptor, Event, decode_batch

log = logging.getLogger(__name__)

Apply = Callable[[int, float, list[Event]], None]


class RankFeed:
    """One (worker, DP rank) subscription with gap replay and restart detection."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        desc: Descriptor,
        rank: int,
        apply: Apply,
        on_reset: Callable[[int], None],
        on_gap_lost: Callable[[int], None],
        replay_timeout_s: float = 1.0,
    ) -> None:
        self._ctx, self._desc, self.rank = ctx, desc, rank
        self._apply, self._on_reset, self._on_gap_lost = apply, on_reset, on_gap_lost
        self._replay_timeout = replay_timeout_s
        self.last_seq: int | None = None
        self._replayed: set[int] = set()
        self.batches = 0
        self.replays = 0
        self.restarts = 0
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, desc.topic.encode())
        self._sock.connect(f"tcp://{desc.host}:{desc.port_base + rank}")

    async def run(self) -> None:
        """Catch up from the replay buffer, then follow the live stream until cancelled."""
        try:
            if self._desc.replay_port_base is not None:
                await self._catch_up(0, None)
            while True:
                _topic, seq8, payload = (await self._sock.recv_multipart())[:3]
                await self._on_message(SEQ.unpack(seq8)[0], payload)
        finally:
            self.close()

    def close(self) -> None:
        """Close the SUB socket (idempotent; ``run`` does it when cancelled)."""
        if not self._sock.closed:
            self._sock.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if seq in self._replayed:
            return  # already applied from the replay buffer
        self._replayed.clear()
        if last is not None and seq <= last:
            self.restarts += 1
            self._on_reset(self.rank)
            self.last_seq = None
            if seq > 0 and self._desc.replay_port_base is not None:
                await self._catch_up(0, seq)
        elif last is not None and seq > last + 1 and not await self._catch_up(last + 1, seq):
            self._on_gap_lost(self.rank)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            ts, events, _ = decode_batch(payload)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            log.warning("kv events: undecodable batch %d: %s", seq, exc)
            return
        self.last_seq = seq
        self.batches += 1
        self._apply(self.rank, ts, events)

    async def _catch_up(self, start: int, before: int | None) -> bool:
        """Apply buffered batches ``start ≤ seq < before``; False if ``start`` is lost."""
        if self._desc.replay_port_base is None:
            return False
        self.replays += 1
        got = await self._replay(start)
        if got is None or (before is not None and (not got or got[0][0] != start)):
            return False
        if before is None and got and got[0][0] != start:
            log.info("kv events: replay buffer starts at %d; history before is lost", got[0][0])
        for seq, payload in got:
            if before is None or seq < before:
                self._deliver(seq, payload)
                self._replayed.add(seq)
        return True

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            assert self._desc.replay_port_base is not None
            dealer.connect(f"tcp://{self._desc.host}:{self._desc.replay_port_base + self.rank}")
            await dealer.send_multipart([b"", SEQ.pack(start)])
            out: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    seq8, payload = frames[-2], frames[-1]  # 0.5.23 has a topic before seq
                    seq = SEQ.unpack(seq8)[0]
                    if seq == END_SEQ:
                        return out
                    out.append((seq, payload))
        except TimeoutError:
            return None
        finally:
            dealer.close(linger=0)
