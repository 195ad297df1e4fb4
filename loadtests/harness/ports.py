"""Free loopback ports for tests and benchmarks (the one copy).

- :func:`free_port`: a port free on 127.0.0.1 right now (the OS's choice).
- :func:`free_ports`: ``n`` distinct such ports (all bound at once, then released).
- :func:`free_port_range`: a base port ``P`` with ``P .. P+n-1`` free right now, for
  ``python -m simulator --base-port P --workers n`` (which serves consecutive ports).

All are best effort: the machine is shared, so another process may take a port between
this check and its use.
"""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS's choice)."""
    return free_ports(1)[0]


def free_port_range(n: int, attempts: int = 50) -> int:
    """A base port with ``n`` consecutive free ports from it (best effort)."""
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind((LOOPBACK, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {LOOPBACK}")
