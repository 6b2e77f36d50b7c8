"""Fleet simulator vocabulary: links, regions, islands, a scenario, and the measured costs.

Pure data and pure rules (no I/O except :func:`load_costs`, which reads the other benches'
JSON). Units: bytes, seconds, bits per second only where a field name says ``gbps``/``mbps``.
Every assumption a number rests on is a field here, documented in docs/fleet.md.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

#: What crosses the links each step: rollpatch patches, XOR+zstd-1 deltas (Stitch's method,
#: same board and relays, only the codec differs), or the whole served checkpoint
#: (INTELLECT-2's shardcast: origin → regional middle node → islands).
Method = Literal["rollpatch", "xor", "full"]
METHODS: tuple[Method, ...] = ("rollpatch", "xor", "full")

#: TCP segment payload used by the loss model (bytes).
MSS = 1448
#: Linux's initial congestion window (segments, RFC 6928).
INITCWND = 10


@dataclass(frozen=True, kw_only=True)
class Link:
    """One network path (per direction): capacity, round trip, random loss.

    A loss rate caps each TCP stream at the Mathis et al. (1997) steady state,
    ``MSS / RTT * 1.22 / sqrt(loss)``; ``streams`` parallel connections add up, and the link
    capacity caps the sum.
    """

    #: Capacity, bits per second.
    bps: float
    #: Round trip, seconds (one per request: S3/relay GETs are request/response).
    rtt_s: float
    #: Packet loss probability (0: none).
    loss: float = 0.0
    #: Parallel TCP streams used for bulk transfers on this link.
    streams: int = 16
    #: Each request opens a new TCP connection (one more round trip for the handshake), as
    #: the relays' upstream requests do today (the demo's emulated link counts about one
    #: connection per request).
    new_connection: bool = True
    #: Each transfer starts in TCP slow start (``INITCWND`` segments per stream, doubling
    #: every round trip up to the path's bandwidth-delay product): a fresh connection, or
    #: Linux restarting the window after an idle period.
    slow_start: bool = True

    @property
    def request_s(self) -> float:
        """Seconds before a request's first byte of answer: a round trip, plus one for the
        TCP handshake when every request opens its connection."""
        return self.rtt_s * (2 if self.new_connection else 1)

    def transfer_s(self, size: float) -> float:
        """Seconds to move ``size`` bytes after the request, slow start included."""
        rate = self.rate
        if not self.slow_start or self.rtt_s <= 0 or size <= 0:
            return size / rate
        cwnd, bdp = float(INITCWND * MSS * self.streams), rate * self.rtt_s
        sent = t = 0.0
        while cwnd < bdp and sent + cwnd < size:
            sent, t, cwnd = sent + cwnd, t + self.rtt_s, cwnd * 2
        return t + (size - sent) / rate

    def __post_init__(self) -> None:
        if not (self.bps > 0 and self.rtt_s >= 0 and 0 <= self.loss < 1 and self.streams >= 1):
            raise ValueError(f"bad link {self}")

    @property
    def rate(self) -> float:
        """Achievable bulk rate, bytes per second."""
        cap = self.bps / 8
        if self.loss <= 0 or self.rtt_s <= 0:
            return cap
        per_stream = MSS / self.rtt_s * 1.22 / math.sqrt(self.loss)
        return min(cap, per_stream * self.streams)


@dataclass(frozen=True, kw_only=True)
class Region:
    """A region: its islands and the path from the trainer's origin store to its relay."""

    name: str
    #: Rollout islands (engine replicas) in the region.
    islands: int
    #: Origin store → this region's relay. The trainer's own region uses an intra-region link.
    upstream: Link
    #: True for the trainer's region (its traffic is not egress).
    home: bool = False
    #: False: islands read the origin directly (no relay, no TTL caches; the demo's "local").
    relayed: bool = True


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A fleet and a run. Defaults are the issue's frontier scenario (docs/fleet.md)."""

    name: str = "frontier"
    regions: tuple[Region, ...] = ()
    #: Served view bytes (1T parameters in FP8 with block scales: ~1.0 TB).
    view_bytes: float = 1.0e12
    #: Served format whose measured codec costs apply (a row of bench/out/codec*.json).
    format: str = "fp8-e4m3-block128"
    #: Patch size as a fraction of the view, drawn uniformly in [lo, hi] per step.
    patch_frac: tuple[float, float] = (0.005, 0.02)
    #: Seconds between two trainer steps (publish() calls).
    step_s: float = 60.0
    #: Steps simulated after v0 (every island starts on v0).
    steps: int = 50
    keyframe_every: int = 25
    #: Trainer ranks publishing a shard each (patch objects per version = ranks).
    ranks: int = 128
    #: CPU cores each rank gives the encoder (the codec's per-core rate is measured).
    rank_cores: int = 4
    #: Each rank's upload bandwidth to the origin store, bits per second.
    rank_upload_bps: float = 25e9
    #: Origin store metadata round trip (manifest, LATEST puts), seconds.
    origin_rtt_s: float = 0.02
    #: Follower poll period (s), relay pointer / listing TTLs (s): RelayConfig defaults.
    poll_s: float = 1.0
    pointer_ttl_s: float = 0.5
    list_ttl_s: float = 1.0
    #: Relay tier serving capacity per region (bits per second, all relay nodes together).
    relay_bps: float = 800e9
    #: One island's ingress (all its nodes together), bits per second.
    island_bps: float = 400e9
    #: Relay → island request round trip (s) and per-request service overhead (s).
    lan_rtt_s: float = 0.001
    #: CPU cores of one island that decode and apply (all its nodes together).
    apply_cores: int = 128
    #: Decode each shard object of a one-step plan as it arrives, overlapping decode with the
    #: fetch (the follower's ``EarlyDecode``, for every version it decodes itself: sliced
    #: versions, engines that do not decode patches in their own workers); the re-hash that
    #: verifies the joined patch still follows the last object. False: decode after the last
    #: object (the follower before; an engine decoding unsliced steps itself).
    overlap_apply: bool = True
    #: Engine pause of a commit (writes only; staging happens while serving), seconds.
    commit_s: float = 0.5
    #: Full-checkpoint method: an island loads a received checkpoint at this rate (B/s).
    load_Bps: float = 20e9
    #: Full-checkpoint method: the regional middle node polls the origin this often (s).
    full_poll_s: float = 1.0
    #: Rollout requests per second per island, and the staleness bound they carry.
    requests_per_s: float = 2.0
    max_lag: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.patch_frac
        if not (0 < lo <= hi < 1):
            raise ValueError(f"patch_frac: need 0 < lo <= hi < 1, got {self.patch_frac}")
        if self.steps < 1 or self.ranks < 1 or self.view_bytes <= 0 or self.step_s <= 0:
            raise ValueError("steps, ranks, view_bytes and step_s must be positive")
        if not self.regions or sum(r.home for r in self.regions) != 1:
            raise ValueError("need regions, exactly one of them home=True")


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-core CPU costs measured on this machine, as seconds per byte of served view at a
    given patch fraction f: ``a + b * f`` (least squares over the codec bench's rows), plus
    XOR+zstd-1's size relative to rollpatch's patch and BLAKE3's hashing rate."""

    format: str
    enc: tuple[float, float]
    dec: tuple[float, float]
    xor_enc: tuple[float, float]
    xor_dec: tuple[float, float]
    #: The part of ``dec`` that verifies after writing (re-hashing the touched tensors: the
    #: bench's full-digest decode minus its O(change)-digest one); it runs after the join.
    dec_verify: tuple[float, float] = (0.0, 0.0)
    #: XOR+zstd-1 bytes / rollpatch patch bytes (mean over the rows).
    xor_ratio: float
    #: BLAKE3 bytes per second on one core (measured at start).
    blake3_Bps: float
    source: list[str] = field(default_factory=list)

    def seconds(self, which: tuple[float, float], view: float, frac: float, cores: int) -> float:
        a, b = which
        return max(a + b * frac, 0.0) * view / cores


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; a single distinct x gives ``(mean y, 0)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def measure_blake3(nbytes: int = 64 << 20) -> float:
    """BLAKE3 bytes per second of one core on ``nbytes`` (best of 3)."""
    import blake3

    data = bytes(nbytes)
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        blake3.blake3(data).digest()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def load_costs(paths: list[Path], fmt: str, *, blake3_Bps: float) -> Costs:
    """Fit per-core costs of ``fmt`` from codec-bench JSON files (rows with one thread)."""
    enc: list[tuple[float, float]] = []
    dec: list[tuple[float, float]] = []
    xenc: list[tuple[float, float]] = []
    xdec: list[tuple[float, float]] = []
    verify: list[tuple[float, float]] = []
    ratios: list[float] = []
    used: list[str] = []
    for p in paths:
        if not p.exists():
            continue
        rows = [
            r
            for r in json.loads(p.read_text()).get("rows", [])
            if r.get("format") == fmt and r.get("threads") == 1
        ]
        for r in rows:
            view, n = float(r["view_bytes"]), max(int(r.get("transitions", 1)), 1)
            frac = r["patch_bytes"] / n / view
            enc.append((frac, r["enc_s"]["native"] / view))
            dec.append((frac, r["dec_s"]["native"] / view))
            inc = r["dec_s"].get("inc")
            if isinstance(inc, (int, float)) and math.isfinite(inc):
                verify.append((frac, max(r["dec_s"]["native"] - inc, 0.0) / view))
            xenc.append((frac, r["enc_s"]["xor1"] / view))
            xdec.append((frac, r["dec_s"]["xor1"] / view))
            ratios.append(r["xor1_bytes"] / r["patch_bytes"])
        if rows:
            used.append(f"{p} ({len(rows)} rows)")
    if not enc:
        raise SystemExit(
            f"no one-thread rows for format {fmt!r} in {[str(p) for p in paths]}: "
            "run bench/codec.py --json bench/out/codec.json first"
        )
    return Costs(
        format=fmt,
        enc=_fit(enc),
        dec=_fit(dec),
        xor_enc=_fit(xenc),
        xor_dec=_fit(xdec),
        dec_verify=_fit(verify) if verify else (0.0, 0.0),
        xor_ratio=sum(ratios) / len(ratios),
        blake3_Bps=blake3_Bps,
        source=used,
    )
