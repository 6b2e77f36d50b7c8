"""The fleet simulator: one run of a :class:`Scenario` under one :data:`Method`.

Deterministic for a seed. Per region, an event loop over every island's polls (followers poll
LATEST every ``poll_s`` from a random phase) reproduces what the code does:

- **LATEST and listings through a relay** are short-TTL caches (``RelayConfig.pointer_ttl``,
  ``list_ttl``): a read after expiry goes upstream (one round trip; reads arriving meanwhile
  join it), and what it returns is the origin as of half a round trip after it started. A
  listing older than the manifest LATEST names makes ``Board.plan`` refuse; the follower
  retries at its next poll.
- **Manifests and objects** are immutable: the first request in a region fetches upstream,
  single-flight, later ones hit the relay's cache. The upstream link carries one region's
  objects one after another at the link's rate (store-and-forward per object).
- **Islands** fetch the objects of their plan in order at their share of the relay tier
  (``min(island_bps, relay_bps / islands in region)``), each object no earlier than the relay
  has it; then decode and apply (measured per-core cost × ``apply_cores``), then commit.
  A follower behind by several versions fetches the chain of step patches (or the keyframe
  when that is fewer bytes) and decodes each.
- **Full-checkpoint broadcast** (shardcast): the region's middle node polls the origin every
  ``full_poll_s``, pulls the newest complete checkpoint over the upstream link when it is free
  (versions published meanwhile are skipped), then islands pull it from the middle node and
  load it.

Results are per island (commit timeline, time-to-version per version) and per region
(upstream bytes, relay hit rate).
"""

from __future__ import annotations

import bisect
import heapq
import random
from dataclasses import dataclass, field

import numpy as np
from _fleet_model import Costs, Method, Region, Scenario

#: Bytes of one LATEST read, of a listing entry, of a manifest per shard object (JSON).
POINTER_BYTES = 600
LIST_ENTRY_BYTES = 64
MANIFEST_BASE_BYTES = 400
MANIFEST_OBJECT_BYTES = 260


@dataclass
class Version:
    """One published version: when the trainer called publish(), when LATEST named it."""

    n: int
    t_call: float
    t_latest: float
    frac: float
    bytes: float  # payload of this version's step (patch, delta or checkpoint)
    keyframe: bool


@dataclass
class IslandRun:
    region: str
    commits: list[tuple[float, int]] = field(default_factory=list)
    fetched: float = 0.0


@dataclass
class RegionRun:
    name: str
    home: bool
    upstream_bytes: float = 0.0
    served_bytes: float = 0.0


@dataclass
class RunResult:
    method: Method
    versions: list[Version]
    islands: list[IslandRun]
    regions: list[RegionRun]
    publish_s: list[float]


class _TtlCache:
    """A relay's short-TTL entry over a moving upstream value (LATEST or a listing)."""

    def __init__(self, ttl: float, rtt: float) -> None:
        self.ttl, self.rtt = ttl, rtt
        self.seen_at = -1.0  # origin time the cached value reflects
        self.expires = -1.0
        self.flight_end = -1.0
        self.flight_seen = -1.0

    def read(self, x: float) -> tuple[float, float]:
        """A read at ``x``: (time it answers, origin time its value reflects)."""
        if x < self.flight_end:
            return self.flight_end, self.flight_seen
        if x < self.expires:
            return x, self.seen_at
        self.flight_end, self.flight_seen = x + self.rtt, x + self.rtt / 2
        self.seen_at, self.expires = self.flight_seen, x + self.ttl
        return self.flight_end, self.flight_seen


def publish_timeline(
    sc: Scenario, costs: Costs, method: Method
) -> tuple[list[Version], list[float]]:
    """When each version is published (LATEST / checkpoint ready) and how big its step is."""
    rng = random.Random(sc.seed)
    up = sc.rank_upload_bps / 8
    shard = sc.view_bytes / sc.ranks
    out = [Version(0, 0.0, 0.0, 0.0, 0.0, True)]
    spent: list[float] = []
    free = 0.0
    for k in range(1, sc.steps + 1):
        frac = rng.uniform(*sc.patch_frac)
        t_call = k * sc.step_s
        start = max(t_call, free)
        key = sc.keyframe_every > 0 and k % sc.keyframe_every == 0
        if method == "full":
            size = sc.view_bytes
            work = shard / up + shard / (costs.blake3_Bps * sc.rank_cores) + sc.origin_rtt_s
        else:
            xor = method == "xor"
            size = frac * sc.view_bytes * (costs.xor_ratio if xor else 1.0)
            enc = costs.seconds(costs.xor_enc if xor else costs.enc, shard, frac, sc.rank_cores)
            work = enc + size / sc.ranks / up + sc.origin_rtt_s
            if key:
                work += shard / up
            work += 2 * sc.origin_rtt_s  # manifest, then LATEST
        free = start + work
        spent.append(free - t_call)
        out.append(Version(k, t_call, free, frac, size, key))
    return out, spent


def _share(sc: Scenario, region: Region) -> float:
    """Bytes per second one island gets from its relay (or the origin when not relayed)."""
    if not region.relayed:
        return region.upstream.rate
    return min(sc.island_bps / 8, sc.relay_bps / 8 / max(region.islands, 1))


def _pipeline(start: float, avail: np.ndarray, sizes: np.ndarray, rate: float) -> np.ndarray:
    """Finish times of handling objects in order at ``rate``, each no earlier than it is
    available: f_j = max(f_{j-1}, avail_j) + s_j / rate, f_{-1} = start."""
    dur = sizes / rate
    cum = np.cumsum(dur)
    before = cum - dur
    return cum + np.maximum(start, np.maximum.accumulate(avail - before))


class _Region:
    """Per-region state of the patch methods: relay caches, upstream link, objects held."""

    def __init__(
        self, sc: Scenario, costs: Costs, region: Region, versions: list[Version], method: Method
    ) -> None:
        self.sc, self.costs, self.region, self.vs, self.method = sc, costs, region, versions, method
        self.t_latest = [v.t_latest for v in versions]
        rtt = region.upstream.request_s
        self.pointer = _TtlCache(sc.pointer_ttl_s if region.relayed else 0.0, rtt)
        self.listing = _TtlCache(sc.list_ttl_s if region.relayed else 0.0, rtt)
        self.kf_listing = _TtlCache(sc.list_ttl_s if region.relayed else 0.0, rtt)
        self.manifest_at: dict[int, float] = {}
        self.objects_at: dict[int, np.ndarray] = {}
        self.link_free = 0.0
        self.run = RegionRun(region.name, region.home)

    def latest_at(self, t: float) -> int:
        return max(bisect.bisect_right(self.t_latest, t) - 1, 0)

    def _upstream(self, nbytes: float) -> None:
        self.run.upstream_bytes += nbytes

    def manifests(self, x: float, chain: list[int]) -> float:
        """Time the island has every manifest of ``chain`` (relay single-flight)."""
        done = x
        for v in chain:
            if v not in self.manifest_at or not self.region.relayed:
                link = self.region.upstream
                self.manifest_at[v] = (
                    x
                    + link.request_s
                    + link.transfer_s(MANIFEST_BASE_BYTES + MANIFEST_OBJECT_BYTES * self.sc.ranks)
                )
                self._upstream(MANIFEST_BASE_BYTES + MANIFEST_OBJECT_BYTES * self.sc.ranks)
            done = max(done, self.manifest_at[v])
        return done + self.sc.lan_rtt_s

    def objects(self, x: float, v: int, sizes: np.ndarray) -> np.ndarray:
        """Arrival times of version ``v``'s objects at the relay (fetched once per region)."""
        if v in self.objects_at and self.region.relayed:
            return self.objects_at[v]
        link = self.region.upstream
        if not self.region.relayed:  # each island reads the origin itself
            return np.full(len(sizes), x + link.rtt_s)
        total = float(sizes.sum())
        ramp = link.transfer_s(total) - total / link.rate  # slow start, once per batch
        start = max(x + link.request_s, self.link_free) + ramp
        arrive = start + np.cumsum(sizes) / link.rate
        self.link_free = float(arrive[-1])
        self._upstream(float(sizes.sum()))
        self.objects_at[v] = arrive
        return arrive


def _plan(sc: Scenario, versions: list[Version], have: int, want: int) -> tuple[list[int], bool]:
    """Versions whose step objects the follower fetches, or (newest keyframe ≤ want, True)
    when the keyframe and the chain after it are fewer bytes."""
    chain = list(range(have + 1, want + 1))
    chain_bytes = sum(versions[v].bytes for v in chain)
    kf = max((v for v in range(have + 1, want + 1) if versions[v].keyframe), default=None)
    if kf is not None:
        alt = sc.view_bytes + sum(versions[v].bytes for v in range(kf + 1, want + 1))
        if alt < chain_bytes:
            return [kf, *range(kf + 1, want + 1)], True
    return chain, False


def _simulate_patch_region(
    sc: Scenario,
    costs: Costs,
    region: Region,
    versions: list[Version],
    method: Method,
    rng: random.Random,
) -> tuple[list[IslandRun], RegionRun]:
    st = _Region(sc, costs, region, versions, method)
    n_obj = sc.ranks
    final = versions[-1].n
    share = _share(sc, region)
    islands = [IslandRun(region.name, [(0.0, 0)]) for _ in range(region.islands)]
    served = [0] * region.islands
    heap = [(rng.uniform(0, sc.poll_s), i) for i in range(region.islands)]
    heapq.heapify(heap)
    dec = costs.xor_dec if method == "xor" else costs.dec
    while heap:
        x, i = heapq.heappop(heap)
        if served[i] >= final:
            continue
        before = st.pointer.expires
        done, seen_t = st.pointer.read(x)
        if region.relayed and st.pointer.expires != before:
            st._upstream(POINTER_BYTES)
        done += sc.lan_rtt_s
        st.run.served_bytes += POINTER_BYTES
        want = st.latest_at(seen_t)
        if want <= served[i]:
            heapq.heappush(heap, (done + sc.poll_s, i))
            continue
        before = st.listing.expires
        done_l, listed_t = st.listing.read(done)
        if region.relayed and st.listing.expires != before:
            st._upstream(LIST_ENTRY_BYTES * len(versions))
        done = done_l + sc.lan_rtt_s
        if st.latest_at(listed_t) < want:  # stale listing: plan refuses, retry later
            heapq.heappush(heap, (done + sc.poll_s, i))
            continue
        done = st.kf_listing.read(done)[0] + sc.lan_rtt_s  # plan lists keyframes too
        chain, from_kf = _plan(sc, versions, served[i], want)
        done = st.manifests(done, chain)
        avail, sizes = [], []
        for j, v in enumerate(chain):
            size = sc.view_bytes if (from_kf and j == 0) else versions[v].bytes
            per = np.full(n_obj, size / n_obj)
            key = -v if (from_kf and j == 0) else v
            avail.append(st.objects(done, key, per))
            sizes.append(per)
        a, s = np.concatenate(avail), np.concatenate(sizes)
        got = _pipeline(done + sc.lan_rtt_s, a, s, share)
        islands[i].fetched += float(s.sum())
        st.run.served_bytes += float(s.sum())
        apply_s = sum(
            costs.seconds(dec, sc.view_bytes, versions[v].frac, sc.apply_cores)
            for v in chain
            if not (from_kf and v == chain[0])
        )
        if from_kf:
            apply_s += sc.view_bytes / sc.load_Bps
        if sc.overlap_apply and len(chain) == 1 and not from_kf and len(got) > 1:
            # EarlyDecode: each shard object decoded as soon as it arrived (one at a time, on
            # every core); the verifying re-hash of the joined patch follows the last one
            verify_s = 0.0
            if method != "xor":
                verify_s = costs.seconds(
                    costs.dec_verify, sc.view_bytes, versions[chain[0]].frac, sc.apply_cores
                )
            verify_s = min(verify_s, apply_s)
            per = np.full(len(got), (apply_s - verify_s) / len(got))
            t = float(_pipeline(float(got[0]), got, per, 1.0)[-1]) + verify_s + sc.commit_s
        else:  # decode after every object arrived (several steps, a keyframe, one object)
            t = float(got[-1]) + apply_s + sc.commit_s
        served[i] = want
        islands[i].commits.append((t, want))
        heapq.heappush(heap, (t + sc.poll_s, i))
    return islands, st.run


def _simulate_full_region(
    sc: Scenario, region: Region, versions: list[Version], rng: random.Random
) -> tuple[list[IslandRun], RegionRun]:
    run = RegionRun(region.name, region.home)
    ready = [v.t_latest for v in versions]
    final = versions[-1].n
    link = region.upstream
    # The middle node: poll, pull the newest ready checkpoint, repeat.
    mid: list[tuple[float, int]] = [(0.0, 0)]
    x, have = rng.uniform(0, sc.full_poll_s), 0
    while have < final:
        newest = max(bisect.bisect_right(ready, x) - 1, 0)
        if newest > have:
            if region.relayed:
                x += link.request_s + link.transfer_s(sc.view_bytes)
                run.upstream_bytes += sc.view_bytes
            have = newest
            mid.append((x, have))
        x += sc.full_poll_s
    mid_t = [t for t, _ in mid]
    share = _share(sc, region)
    islands = []
    for _ in range(region.islands):
        isl = IslandRun(region.name, [(0.0, 0)])
        x, served = rng.uniform(0, sc.poll_s), 0
        while served < final:
            k = bisect.bisect_right(mid_t, x) - 1
            v = mid[k][1]
            if v > served:
                x += sc.lan_rtt_s + sc.view_bytes / share + sc.view_bytes / sc.load_Bps
                isl.fetched += sc.view_bytes
                run.served_bytes += sc.view_bytes
                served = v
                isl.commits.append((x, v))
            x += sc.poll_s
        islands.append(isl)
    return islands, run


def simulate(
    sc: Scenario, costs: Costs, method: Method, versions: list[Version] | None = None
) -> RunResult:
    """Run ``sc`` under ``method``: every island from v0 to the last version. ``versions``:
    a measured publish timeline instead of the modelled one (validation)."""
    if versions is None:
        versions, spent = publish_timeline(sc, costs, method)
    else:
        spent = [v.t_latest - v.t_call for v in versions[1:]]
    rng = random.Random(sc.seed + 1)
    islands: list[IslandRun] = []
    regions: list[RegionRun] = []
    for region in sc.regions:
        if method == "full":
            isl, reg = _simulate_full_region(sc, region, versions, rng)
        else:
            isl, reg = _simulate_patch_region(sc, costs, region, versions, method, rng)
        islands += isl
        regions.append(reg)
    return RunResult(method, versions, islands, regions, spent)
