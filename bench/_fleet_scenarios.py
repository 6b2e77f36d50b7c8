"""The fleets the simulator reports: the issue's frontier scenario and its variants."""

from __future__ import annotations

import dataclasses

from _fleet_model import Link, Region, Scenario

#: Round trips from the trainer's region to the four others (s): a US-east trainer to
#: US-west, Europe, Asia, Oceania on cloud backbones.
FRONTIER_RTTS = (0.065, 0.085, 0.160, 0.200)


def frontier(
    *,
    islands: int = 100,
    regions: int = 5,
    inter_bps: float = 10e9,
    loss: float = 0.0,
    streams: int = 16,
    **overrides: object,
) -> Scenario:
    """1T parameters served in FP8 (~1 TB view), ``islands`` islands spread evenly over
    ``regions`` regions (one of them the trainer's), a step every 60 s, patches at 0.5–2% of
    the view, a keyframe every 25 steps, ``inter_bps`` between regions."""
    per = [islands // regions + (1 if r < islands % regions else 0) for r in range(regions)]
    regs = [Region(name="home", islands=per[0], home=True, upstream=Link(bps=400e9, rtt_s=0.002))]
    for r in range(1, regions):
        rtt = FRONTIER_RTTS[(r - 1) % len(FRONTIER_RTTS)]
        regs.append(
            Region(
                name=f"r{r}",
                islands=per[r],
                upstream=Link(bps=inter_bps, rtt_s=rtt, loss=loss, streams=streams),
            )
        )
    sc = Scenario(name="frontier", regions=tuple(regs))
    return dataclasses.replace(sc, **overrides) if overrides else sc  # type: ignore[arg-type]
