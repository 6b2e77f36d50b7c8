"""The fleet simulator (bench/fleet.py): its building blocks and invariants of a small run."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _fleet_metrics import summarize, ttvs
from _fleet_model import Costs, Link, load_costs
from _fleet_scenarios import frontier
from _fleet_sim import _pipeline, _TtlCache, simulate

COSTS = Costs(
    format="fp8-e4m3-block128",
    enc=(1e-9, 1e-7),
    dec=(1e-9, 1e-7),
    xor_enc=(1e-9, 5e-8),
    xor_dec=(1e-9, 1e-8),
    xor_ratio=3.0,
    blake3_Bps=1e9,
)


def small(**kw: object):
    return frontier(islands=6, regions=3, steps=6, view_bytes=1e10, ranks=8, **kw)


def test_link_rate_caps_and_loss() -> None:
    assert Link(bps=8e9, rtt_s=0.1).rate == 1e9
    lossy = Link(bps=8e9, rtt_s=0.1, loss=1e-4, streams=4)
    assert lossy.rate == pytest.approx(4 * 1448 / 0.1 * 1.22 / math.sqrt(1e-4))
    with pytest.raises(ValueError):
        Link(bps=0, rtt_s=0.1)


def test_link_handshake_and_slow_start() -> None:
    """A request on a new connection costs two round trips; a transfer ramps from 10
    segments per stream, doubling per round trip, until the window fills the path."""
    wan = Link(bps=10e6, rtt_s=0.1, streams=1)
    assert wan.request_s == pytest.approx(0.2)
    assert dataclasses.replace(wan, new_connection=False).request_s == pytest.approx(0.1)
    w0 = 10 * 1448  # the BDP is 125 kB: rounds of 14.5, 29, 58 kB, then the link's rate
    size = 156_000
    rest = size - 7 * w0
    assert wan.transfer_s(size) == pytest.approx(3 * 0.1 + rest / wan.rate)
    assert dataclasses.replace(wan, slow_start=False).transfer_s(size) == size / wan.rate
    assert wan.transfer_s(1000) == pytest.approx(1000 / wan.rate)  # fits the first window
    fat = Link(bps=10e9, rtt_s=0.2, streams=16)  # a 1 TB view: the ramp is negligible
    assert fat.transfer_s(1e12) < 1e12 / fat.rate * 1.01


def test_pipeline_matches_a_loop() -> None:
    rng = np.random.default_rng(0)
    avail, sizes = np.sort(rng.uniform(0, 10, 50)), rng.uniform(1, 5, 50)
    f, out = 3.0, []
    for a, s in zip(avail, sizes):
        f = max(f, a) + s / 2.0
        out.append(f)
    assert np.allclose(_pipeline(3.0, avail, sizes, 2.0), out)


def test_ttl_cache_joins_flights_and_expires() -> None:
    c = _TtlCache(ttl=0.5, rtt=0.2)
    assert c.read(1.0) == pytest.approx((1.2, 1.1))  # miss: one round trip
    assert c.read(1.1) == pytest.approx((1.2, 1.1))  # joins the flight
    assert c.read(1.3) == pytest.approx((1.3, 1.1))  # hit, value as of the fetch
    assert c.read(1.6)[1] == pytest.approx(1.7)  # expired (started + ttl): refetch


def test_patch_run_invariants() -> None:
    sc = small()
    res = simulate(sc, COSTS, "rollpatch")
    assert all(isl.commits[-1][1] == sc.steps for isl in res.islands)
    s = summarize(sc, res)
    payload = sum(v.bytes for v in res.versions[1:])
    remote = sum(not r.home for r in sc.regions)
    # every remote region pulls each patch across its link exactly once, plus metadata
    assert 1.0 <= s.egress_ratio < 1.01
    assert s.egress_per_step * sc.steps == pytest.approx(payload * remote, rel=0.01)
    islands_per_region = sc.regions[1].islands
    assert s.relay_hit == pytest.approx(1 - 1 / islands_per_region, abs=0.01)
    assert np.isfinite(ttvs(res)).all() and s.ttv_p95_s > 0
    assert sum(s.lag.values()) == pytest.approx(1.0)


def test_slower_links_and_bigger_payloads_take_longer() -> None:
    fast = summarize(small(), simulate(small(), COSTS, "rollpatch"))
    slow_sc = small(inter_bps=1e9)
    slow = summarize(slow_sc, simulate(slow_sc, COSTS, "rollpatch"))
    xor = summarize(small(), simulate(small(), COSTS, "xor"))
    assert slow.ttv_p95_s > fast.ttv_p95_s
    assert xor.egress_per_step == pytest.approx(3.0 * fast.egress_per_step, rel=0.01)


def test_full_broadcast_moves_whole_views() -> None:
    sc = dataclasses.replace(small(), step_s=600.0)
    res = simulate(sc, COSTS, "full")
    for reg in res.regions:
        if not reg.home:
            assert reg.upstream_bytes > 0 and reg.upstream_bytes % sc.view_bytes == 0
    assert all(isl.commits[-1][1] == sc.steps for isl in res.islands)


def test_costs_are_fitted_from_codec_rows(tmp_path: Path) -> None:
    rows = [
        {
            "format": "bf16",
            "threads": 1,
            "transitions": 1,
            "view_bytes": 1000,
            "patch_bytes": p,
            "xor1_bytes": 3 * p,
            "enc_s": {"native": 1e-6 * (1 + p / 10), "xor1": 1e-6},
            "dec_s": {"native": 2e-6, "xor1": 1e-6},
        }
        for p in (10, 20, 40)
    ]
    path = tmp_path / "codec.json"
    path.write_text(__import__("json").dumps({"rows": rows}))
    c = load_costs([path], "bf16", blake3_Bps=1.0)
    assert c.xor_ratio == pytest.approx(3.0)
    assert c.enc[0] == pytest.approx(1e-9) and c.enc[1] == pytest.approx(1e-7)
    with pytest.raises(SystemExit):
        load_costs([path], "nvfp4", blake3_Bps=1.0)
