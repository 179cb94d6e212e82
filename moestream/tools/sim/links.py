"""Links and fabrics: how long a message of b bytes takes between two ranks.

A :class:`Link` is one class of connection seen from one GPU port, per direction:

- ``startup_us`` (alpha): per-message cost that *occupies the port* (a message-rate limit). This
  is the classic alpha-beta (Hockney) model and the reason DeepEP aggregates tokens into chunks
  before a host- or NIC-issued transfer: n messages of b bytes keep the port busy
  ``n * (alpha + b / beta)``.
- ``gbps`` (beta): bandwidth per GPU per direction, GB/s = 1e3 bytes/µs.
- ``latency_us``: flight time added to each message's arrival; it does not occupy the port, so
  it pipelines across messages.
- ``outstanding_per_sm``: for *device-initiated* transfers (a Triton/TMA pull issued by an SM),
  the requests each communication SM keeps in flight. With W = comm_sms * outstanding_per_sm
  requests and round trip (service + latency), the port serves at most W per round trip
  (Little's law), so a message occupies the port for ``max(service, (service + latency) / W)``.
  ``None`` means the transfer engine (host copy engine, NIC) queues messages without SMs.

A :class:`Fabric` says which link joins two ranks: ``local`` for a rank's own picks (an HBM
copy), ``intra`` inside a domain of ``domain_size`` consecutive ranks, ``inter`` between
domains.

Assumptions beyond the calibration (documented in docs/simulator.md):

- NVLink-4 device pulls: 354 GB/s (the measured Triton pull), no per-message start-up (the
  measured pull of 7 KB rows in random order ran at line rate), latency = half the measured
  flag round trip (1.3 µs), 4 requests in flight per communication SM (not measured; it only
  binds for small rows and few comm SMs).
- Host-issued NVLink copies (``nvlink-copy``): start-up and rate fitted to the measured copy
  curve (~7.6 µs, 364 GB/s).
- RDMA: 50 GB/s per GPU (one 400 Gb/s NIC per GPU), 4 µs start-up per message (the middle of
  the 3-5 µs usually quoted for a verbs post + doorbell + completion through one channel),
  2 µs flight latency, NIC-queued. GPU-initiated RDMA with many queue pairs pipelines most of
  the start-up; build ``Link("rdma-gda", gbps=50, latency_us=3, outstanding_per_sm=...)`` to
  study that case.
- NVL72: NVLink-5, 900 GB/s nominal per direction derated by the efficiency measured on NVLink-4
  (354 / 450), same latency and requests in flight as NVLink-4, 72 GPUs per domain, RDMA
  between racks. The GPU itself stays the calibrated H200: only the fabric changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .calib import Calibration

__all__ = ["Link", "Fabric", "make_fabric", "LINK_KINDS", "LOCAL", "INTRA", "INTER",
           "CLASS_NAMES", "RDMA_GBPS", "RDMA_STARTUP_US", "RDMA_LATENCY_US",
           "OUTSTANDING_PER_SM", "NVLINK4_NOMINAL_GBPS", "NVLINK5_NOMINAL_GBPS", "NVL72_DOMAIN"]

# Link classes of a message (index into Fabric.links()).
LOCAL, INTRA, INTER = 0, 1, 2
CLASS_NAMES = ("local", "intra", "inter")

RDMA_GBPS = 50.0              # 400 Gb/s per GPU (ConnectX-7 class NIC per GPU)
RDMA_STARTUP_US = 4.0         # per message, occupies the NIC channel
RDMA_LATENCY_US = 2.0         # one-way flight, pipelined
OUTSTANDING_PER_SM = 4        # device-initiated requests in flight per comm SM (assumed)
NVLINK4_NOMINAL_GBPS = 450.0  # H100/H200: 18 links x 25 GB/s per direction
NVLINK5_NOMINAL_GBPS = 900.0  # B200/GB200: 18 links x 50 GB/s per direction
NVL72_DOMAIN = 72

LINK_KINDS = ("nvlink", "nvlink-copy", "rdma", "nvl72")


@dataclass(frozen=True)
class Link:
    """One link class, per GPU and direction (see the module docstring for the model)."""

    name: str
    gbps: float
    startup_us: float = 0.0
    latency_us: float = 0.0
    outstanding_per_sm: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gbps, bool) or not isinstance(self.gbps, (int, float)) \
                or not self.gbps > 0:
            raise ValueError(f"Link {self.name!r}: gbps must be > 0 (math.inf allowed), "
                             f"got {self.gbps!r}")
        for key in ("startup_us", "latency_us"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"Link {self.name!r}: {key} must be a finite number >= 0, "
                                 f"got {v!r}")
        o = self.outstanding_per_sm
        if o is not None and (isinstance(o, bool) or not isinstance(o, int) or o <= 0):
            raise ValueError(f"Link {self.name!r}: outstanding_per_sm must be None (engine-"
                             f"queued) or a positive int, got {o!r}")

    @property
    def device_initiated(self) -> bool:
        """True when SMs issue the transfers (their number limits requests in flight)."""
        return self.outstanding_per_sm is not None

    def service_us(self, nbytes: np.ndarray | float) -> np.ndarray:
        """Start-up plus wire time of messages of ``nbytes`` bytes."""
        return self.startup_us + np.asarray(nbytes, dtype=np.float64) / (self.gbps * 1e3)

    def occupancy_us(self, nbytes: np.ndarray | float, *, comm_sms: int) -> np.ndarray:
        """Time each message keeps the port busy: its service, or the request-window share."""
        s = self.service_us(nbytes)
        if self.outstanding_per_sm is None:
            return s
        window = comm_sms * self.outstanding_per_sm
        return np.maximum(s, (s + self.latency_us) / window)

    def describe(self) -> str:
        issue = (f"{self.outstanding_per_sm} req/SM in flight" if self.device_initiated
                 else "engine-queued")
        return (f"{self.name}: {self.gbps:g} GB/s, start-up {self.startup_us:g} us, "
                f"latency {self.latency_us:g} us, {issue}")


@dataclass(frozen=True)
class Fabric:
    """Which link joins two ranks.

    Ranks ``[k*domain_size, (k+1)*domain_size)`` form domain k and talk over ``intra``; ranks of
    different domains over ``inter``. ``inter=None`` makes the fabric one domain of any size.
    """

    name: str
    intra: Link
    local: Link
    inter: Link | None = None
    domain_size: int | None = None

    def __post_init__(self) -> None:
        if (self.inter is None) != (self.domain_size is None):
            raise ValueError(f"Fabric {self.name!r}: give both inter and domain_size (several "
                             f"domains) or neither (one domain)")
        d = self.domain_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d <= 0):
            raise ValueError(f"Fabric {self.name!r}: domain_size must be a positive int, got {d!r}")

    def links(self) -> tuple[Link, Link, Link | None]:
        """Links indexed by class: (LOCAL, INTRA, INTER)."""
        return (self.local, self.intra, self.inter)

    def link_class(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Class (LOCAL / INTRA / INTER) of messages from ``src`` to ``dst`` ranks."""
        src, dst = np.asarray(src), np.asarray(dst)
        if self.domain_size is None:
            same = np.ones(np.broadcast(src, dst).shape, dtype=bool)
        else:
            same = (src // self.domain_size) == (dst // self.domain_size)
        return np.where(src == dst, LOCAL, np.where(same, INTRA, INTER)).astype(np.int8)

    def classes_between(self, num_ranks: int) -> list[int]:
        """Remote classes that join at least one pair of ``num_ranks`` ranks."""
        if num_ranks <= 1:
            return []
        if self.domain_size is None:
            return [INTRA]
        out = [INTRA] if self.domain_size > 1 else []
        if num_ranks > self.domain_size:
            out.append(INTER)
        return out

    def setup_us(self, num_ranks: int) -> float:
        """Receive-count exchange before dispatch: one flag round trip over the slowest class."""
        links = self.links()
        return max((2.0 * (links[c].startup_us + links[c].latency_us)
                    for c in self.classes_between(num_ranks)), default=0.0)

    def describe(self) -> str:
        if self.inter is None:
            return f"{self.name}: one domain of {self.intra.describe()}"
        return (f"{self.name}: domains of {self.domain_size} over {self.intra.describe()}; "
                f"between domains {self.inter.describe()}")


def nvlink_pull(calib: Calibration, *, name: str = "nvlink") -> Link:
    """NVLink-4 reads issued by SMs (Triton pulls), from the calibration."""
    return Link(name, gbps=calib.device_pull_peer_gbps, startup_us=0.0,
                latency_us=calib.flag_round_trip_us / 2, outstanding_per_sm=OUTSTANDING_PER_SM)


def make_fabric(kind: str, *, calib: Calibration, gpus_per_node: int = 8) -> Fabric:
    """One of ``LINK_KINDS``:

    - ``nvlink``: every rank in one NVLink-4 domain, device-initiated token pulls (an HGX H200
      board holds 8 GPUs; larger domains are a what-if, as in NVLink-switch systems).
    - ``nvlink-copy``: the same domain with host-issued copies (fitted start-up ~7.6 µs).
    - ``rdma``: nodes of ``gpus_per_node`` GPUs on NVLink-4 (device pulls), RDMA between nodes.
    - ``nvl72``: racks of 72 GPUs on NVLink-5 (device pulls), RDMA between racks.
    """
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node <= 0:
        raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
    local = Link("local", gbps=calib.device_pull_local_gbps)
    rdma = Link("rdma", gbps=RDMA_GBPS, startup_us=RDMA_STARTUP_US, latency_us=RDMA_LATENCY_US)
    if kind == "nvlink":
        return Fabric("nvlink", intra=nvlink_pull(calib), local=local)
    if kind == "nvlink-copy":
        startup, gbps = calib.host_copy_model()
        return Fabric("nvlink-copy", intra=Link("nvlink-copy", gbps=gbps, startup_us=startup),
                      local=local)
    if kind == "rdma":
        return Fabric("rdma", intra=nvlink_pull(calib), local=local, inter=rdma,
                      domain_size=gpus_per_node)
    if kind == "nvl72":
        derate = calib.device_pull_peer_gbps / NVLINK4_NOMINAL_GBPS
        nvl5 = Link("nvlink5", gbps=NVLINK5_NOMINAL_GBPS * derate, startup_us=0.0,
                    latency_us=calib.flag_round_trip_us / 2, outstanding_per_sm=OUTSTANDING_PER_SM)
        return Fabric("nvl72", intra=nvl5, local=local, inter=rdma, domain_size=NVL72_DOMAIN)
    raise ValueError(f"unknown link kind {kind!r}; known kinds: {list(LINK_KINDS)}")
