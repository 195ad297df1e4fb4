"""Which worker addresses the admin API may register: a guard against SSRF.

Contract: :class:`HostAllowList` is built from entries that are host names (``localhost``,
``worker-1.internal``), single addresses or CIDR blocks (``10.0.0.0/8``, ``fd00::/8``),
or ``*`` (anything). :meth:`HostAllowList.check` raises :class:`NotAllowed` naming the host
unless the URL's host is listed by name, or is an address inside a listed block, or is a
name whose every resolved address is inside a listed block (resolution through the
``resolve`` callable, so tests need no DNS). Names that resolve to nothing are refused.

The default (:data:`DEFAULT_ALLOWED`) is loopback and the private ranges: what a worker
fleet on one host or one private network uses. Link-local (169.254.0.0/16, the cloud
metadata service; fe80::/10) and every public address are refused unless listed.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from urllib.parse import urlsplit

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], Awaitable[Sequence[str]]]

DEFAULT_ALLOWED: tuple[str, ...] = (
    "localhost",
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)


class NotAllowed(ValueError):
    """The worker URL's host is outside the allow-list; the message says which host."""


def parse_entries(entries: Iterable[str]) -> tuple[frozenset[str], tuple[IPNetwork, ...], bool]:
    """Split entries into (host names, networks, allow_any); ValueError names a bad one."""
    names: set[str] = set()
    nets: list[IPNetwork] = []
    allow_any = False
    for raw in entries:
        entry = raw.strip().lower()
        if not entry:
            raise ValueError("an allow-list entry must not be empty")
        if entry == "*":
            allow_any = True
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if "/" in entry or " " in entry:
            raise ValueError(f"allow-list entry {raw!r} is neither a host name nor a CIDR block")
        names.add(entry.rstrip("."))
    return frozenset(names), tuple(nets), allow_any


async def system_resolve(host: str) -> Sequence[str]:
    """Every address ``host`` resolves to (the event loop's getaddrinfo)."""
    import asyncio

    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # unresolvable, or not even a valid IDNA name
        return ()
    return [str(info[4][0]) for info in infos]


class HostAllowList:
    def __init__(self, entries: Iterable[str], resolve: Resolver = system_resolve) -> None:
        self._names, self._nets, self._any = parse_entries(entries)
        self._resolve = resolve

    def _inside(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
        return any(address in net for net in self._nets if net.version == address.version)

    def decided(self, url: str) -> bool | None:
        """Without resolving: True (allowed by name, address or ``*``), False (an address
        outside every block, or no host), None (a name: :meth:`check` must resolve it)."""
        if self._any:
            return True
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if not host:
            return False
        if host in self._names:
            return True
        try:
            return self._inside(ipaddress.ip_address(host))
        except ValueError:
            return None

    async def check(self, url: str) -> None:
        """Return when ``url``'s host may be registered; raise NotAllowed otherwise."""
        if self._any:
            return
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if not host:
            raise NotAllowed(f"worker URL {url!r} has no host")
        if host in self._names:
            return
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            if self._inside(literal):
                return
            raise NotAllowed(f"worker host {host} is not in the gateway's worker allow-list")
        addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in await self._resolve(host)]
        if addresses and all(self._inside(a) for a in addresses):
            return
        raise NotAllowed(
            f"worker host {host} resolves outside the gateway's worker allow-list"
            if addresses
            else f"worker host {host} does not resolve"
        )
