"""The worker allow-list: names, literal addresses, CIDR blocks, resolution, defaults."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.config.allowlist import DEFAULT_ALLOWED, HostAllowList, NotAllowed, parse_entries


def _resolver(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    async def resolve(host: str) -> Sequence[str]:
        return table.get(host, [])

    return resolve


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://localhost:8000",
        "http://10.1.2.3:30000",
        "http://172.20.0.5:30000",
        "http://192.168.1.10:30000",
        "http://[::1]:30000",
        "http://[fd00::5]:30000",
    ],
)
async def test_default_allows_loopback_and_private(url: str) -> None:
    await HostAllowList(DEFAULT_ALLOWED, _resolver({})).check(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254:80",  # cloud metadata
        "http://[::ffff:169.254.169.254]:80",
        "http://8.8.8.8:80",
        "http://172.32.0.1:80",
        "http://[fe80::1]:80",
        "http://0.0.0.0:80",
        "http://metadata.google.internal:80",  # resolves to nothing here
    ],
)
async def test_default_refuses_the_rest(url: str) -> None:
    with pytest.raises(NotAllowed):
        await HostAllowList(DEFAULT_ALLOWED, _resolver({})).check(url)


async def test_names_resolve_inside_the_blocks() -> None:
    table = {"w1.internal": ["10.0.0.7"], "evil.example": ["10.0.0.8", "203.0.113.9"]}
    allow = HostAllowList(DEFAULT_ALLOWED, _resolver(table))
    await allow.check("http://w1.internal:30000")
    with pytest.raises(NotAllowed, match="resolves outside"):
        await allow.check("http://evil.example:30000")


async def test_explicit_names_and_any() -> None:
    await HostAllowList(["gpu-box"], _resolver({})).check("http://GPU-box:1")
    await HostAllowList(["*"], _resolver({})).check("http://203.0.113.9:1")
    with pytest.raises(NotAllowed):
        await HostAllowList(["gpu-box"], _resolver({})).check("http://127.0.0.1:1")


def test_bad_entries_are_refused() -> None:
    with pytest.raises(ValueError):
        parse_entries(["10.0.0.0/33"])
    with pytest.raises(ValueError):
        parse_entries([""])
