"""KV transfer over a named link: between a prefill and a decode server (prefill/decode
disaggregation, docs/PD.md), and between a GPU and its host's memory (the HiCache host
tier, :mod:`simulator.model.hicache`; the host links are listed at the end).

A request's transfer moves every prompt token's KV, the cached ones and the uncached ones
(a decode server has no radix cache by default, so it holds none of the prompt):

    seconds = fixed_latency_s + tokens x kv_bytes_per_token / (link_gb_s x 1e9 x efficiency)

``kv_bytes_per_token`` is the worker profile's (:mod:`simulator.model.profiles`;
Llama-3-8B in BF16: 32 layers x 2 (K and V) x 8 KV heads x 128 dims x 2 bytes = 131,072
bytes, from the model's ``config.json``). One prefill server's transfers share its link:
:class:`TransferLink` sends them one after another, so a burst of long prompts queues on
the NIC.

The figures and where they come from:

* ``rdma-400g`` (default): one 400 Gb/s ConnectX-7 per GPU, as in a DGX H100 (NVIDIA's
  DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 for the compute fabric), so 50 GB/s line
  rate; ``efficiency`` 0.475 is Mooncake's Transfer Engine figure of 190 GB/s over
  8 x 400 Gb/s RoCE (Mooncake's README and FAST '25 paper), i.e. ≈ 23.75 GB/s per GPU.
* ``rdma-200g``: a host's 4 x 200 Gb/s NICs serving one prefill/decode pair: Mooncake's
  other published figure, 87 GB/s over 100 GB/s of line rate (``efficiency`` 0.87).
* ``tcp-25g``: SGLang's ``mooncake_tcp`` backend over one 25 GbE port: 3.125 GB/s line
  rate; ``efficiency`` 0.9 is an assumption (TCP's framing and a single stream), not a
  measurement.
* ``nvlink-h100``: prefill and decode on GPUs of one node: NVLink 4 gives an H100
  900 GB/s bidirectional, 450 GB/s each way (NVIDIA's H100 datasheet); ``efficiency`` 0.8
  is an assumption.
* ``instant``: no transfer time at all, for what-if runs and tests.

``fixed_latency_s`` (2 ms on the RDMA links, 5 ms over TCP, 1 ms over NVLink) stands for
the per-request protocol around the bytes (the decode's KV indices to the prefill over
ZMQ, the aux data, the completion status, the decode's next poll); it is an assumed
figure, not a measured one: SGLang's ``sglang:kv_transfer_latency_ms`` histogram on a
real pair is where to calibrate it.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.model.profiles import named


@dataclass(frozen=True, slots=True)
class TransferProfile:
    """One named link between a prefill and a decode server (see module docstring)."""

    name: str
    description: str
    link_gb_s: float  # line rate, GB/s (1e9 bytes per second)
    efficiency: float  # the share of the line rate a transfer gets
    fixed_latency_s: float  # per request, on top of the bytes

    @property
    def bytes_per_s(self) -> float:
        """Effective bandwidth in bytes per second (``inf`` for a free link)."""
        rate = self.link_gb_s * 1e9 * self.efficiency
        return rate if rate > 0 else float("inf")

    def transfer_s(self, tokens: int, kv_bytes_per_token: int) -> float:
        """Modelled seconds to move ``tokens`` tokens' KV, latency included."""
        return self.fixed_latency_s + self.bytes_s(tokens * kv_bytes_per_token)

    def bytes_s(self, nbytes: int) -> float:
        """Modelled seconds the bytes alone occupy the link."""
        rate = self.bytes_per_s
        return 0.0 if rate == float("inf") else nbytes / rate


# no transfer time (what-if runs, tests): in both tables below
INSTANT = TransferProfile(
    "instant",
    "no transfer time (what-if runs, tests)",
    link_gb_s=0.0,
    efficiency=1.0,
    fixed_latency_s=0.0,
)

TRANSFER_PROFILES: dict[str, TransferProfile] = {
    p.name: p
    for p in (
        TransferProfile(
            "rdma-400g",
            "one 400 Gb/s RDMA NIC per GPU (DGX H100), Mooncake's 47.5 % of line rate: "
            "≈23.8 GB/s, 2 ms per request",
            link_gb_s=50.0,
            efficiency=0.475,
            fixed_latency_s=2e-3,
        ),
        TransferProfile(
            "rdma-200g",
            "4 x 200 Gb/s RDMA, Mooncake's 87 GB/s: one host's NICs for one pair, 2 ms per request",
            link_gb_s=100.0,
            efficiency=0.87,
            fixed_latency_s=2e-3,
        ),
        TransferProfile(
            "tcp-25g",
            "mooncake_tcp over one 25 GbE port, 90 % of line rate (assumed): ≈2.8 GB/s, "
            "5 ms per request",
            link_gb_s=3.125,
            efficiency=0.9,
            fixed_latency_s=5e-3,
        ),
        TransferProfile(
            "nvlink-h100",
            "prefill and decode GPUs in one H100 node: NVLink 4, 450 GB/s each way, 80 % "
            "(assumed), 1 ms per request",
            link_gb_s=450.0,
            efficiency=0.8,
            fixed_latency_s=1e-3,
        ),
        INSTANT,
    )
}
DEFAULT_TRANSFER_PROFILE = "rdma-400g"


def get_transfer_profile(name: str) -> TransferProfile:
    return named(TRANSFER_PROFILES, name, "transfer profile")


# ---------------------------------------------------------------------- GPU <-> host links
# The link a HiCache load (host -> GPU) or backup (GPU -> host) crosses: one GPU's PCIe
# slot, the same formula (fixed latency + bytes / effective bandwidth), one direction's
# bandwidth (PCIe is full duplex: loads and backups do not share it).
#
# * ``pcie-gen5-x16`` (default; an H100 or H200 in its host): 32 GT/s x 16 lanes with
#   128b/130b encoding = 63.0 GB/s each way (the PCI-SIG's PCIe 5.0 rate; NVIDIA's H100
#   datasheet gives "PCIe Gen5: 128 GB/s", both directions together). ``efficiency``
#   0.85: pinned host-to-device copies reach about that share, e.g. nvbandwidth's
#   host_to_device_memcpy_ce at 55.6 GB/s on a Gen5 host (NVIDIA's nvbandwidth tutorial
#   output); SGLang's HiCache design doc says its GPU-assisted I/O kernels
#   (``--hicache-io-backend kernel``, the default) reach "up to 3x" the speed of plain
#   ``cudaMemcpyAsync`` page copies (``direct``), so this figure is the kernel's and
#   ``direct`` gets a third of it (:data:`DIRECT_IO_SLOWDOWN`).
# * ``pcie-gen4-x16`` (an A100 or L40S): 16 GT/s x 16 = 31.5 GB/s each way (NVIDIA's
#   A100 datasheet: "PCIe Gen4: 64 GB/s" both ways); 0.85 assumed as for Gen5.
# * ``nvlink-c2c`` (a GH200's Hopper reading the Grace CPU's memory): NVLink-C2C's
#   900 GB/s both ways, 450 GB/s each (NVIDIA's GH200 datasheet); 0.8 assumed.
# * ``instant``: no transfer time (what-if runs, tests).
#
# ``fixed_latency_s`` 0.2 ms per merged load or backup (the kernel launches and the
# layer-by-layer completion events of one batch's copy) is assumed, not measured: SGLang's
# ``sglang:load_back_duration_seconds`` and ``sglang:hicache_backup_duration_seconds`` on a
# real server are where to calibrate it and the efficiency.
DIRECT_IO_SLOWDOWN = 3.0

HOST_LINK_PROFILES: dict[str, TransferProfile] = {
    p.name: p
    for p in (
        TransferProfile(
            "pcie-gen5-x16",
            "PCIe 5.0 x16, 63 GB/s each way, 85 % (assumed, near nvbandwidth's pinned "
            "copies): ~53.6 GB/s, 0.2 ms per load or backup",
            link_gb_s=63.0,
            efficiency=0.85,
            fixed_latency_s=0.2e-3,
        ),
        TransferProfile(
            "pcie-gen4-x16",
            "PCIe 4.0 x16, 31.5 GB/s each way, 85 % (assumed): ~26.8 GB/s, 0.2 ms per "
            "load or backup",
            link_gb_s=31.5,
            efficiency=0.85,
            fixed_latency_s=0.2e-3,
        ),
        TransferProfile(
            "nvlink-c2c",
            "a GH200's NVLink-C2C to the Grace CPU's memory, 450 GB/s each way, 80 % "
            "(assumed), 0.2 ms per load or backup",
            link_gb_s=450.0,
            efficiency=0.8,
            fixed_latency_s=0.2e-3,
        ),
        INSTANT,
    )
}
DEFAULT_HOST_LINK = "pcie-gen5-x16"


def get_host_link(name: str) -> TransferProfile:
    return named(HOST_LINK_PROFILES, name, "host link profile")


class TransferLink:
    """One prefill server's outgoing link: transfers go one after another.

    ``send(now, tokens)`` books a transfer that may start at ``now`` and returns when it
    is done (modelled seconds): after the link is free, the bytes, then the fixed latency
    (which does not hold the link)."""

    def __init__(self, profile: TransferProfile, kv_bytes_per_token: int) -> None:
        self.profile = profile
        self.kv_bytes_per_token = kv_bytes_per_token
        self._free_at = 0.0

    def send(self, now: float, tokens: int) -> float:
        start = max(now, self._free_at)
        self._free_at = start + self.profile.bytes_s(tokens * self.kv_bytes_per_token)
        return self._free_at + self.profile.fixed_latency_s
