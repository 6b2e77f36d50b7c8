"""``rollpatch demo`` end to end: a tiny run with real processes (trainer, relays, three
islands) on loopback, its JSON report checked; the MoE run's routing; Ctrl-C stops every
process. The pure parts are tested in test_demo_grpo.py, test_demo_throttle.py,
test_demo_verify.py and test_demo_routing.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# -- end to end --------------------------------------------------------------------------------


def _demo_argv(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollpatch",
        "demo",
        "--no-live",
        "--out",
        str(out),
        "--hidden",
        "64",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--wan-mbps",
        "20",
        "--wan-latency-ms",
        "50",
        *extra,
    ]


def _children_of(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(entry.name))
    return pids


def test_demo_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "demo"
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        _demo_argv(out, "--steps", "4", "--json", str(report_path)),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report_path.read_text())
    assert r["ok"] is True
    assert all(inv["ok"] is True for inv in r["invariants"].values()), r["invariants"]
    assert r["verification"]["checked"] > 0 and r["verification"]["mismatches"] == 0
    assert r["routing"] is None and "routing_replays" not in r["invariants"]  # dense model
    assert [v["version"] for v in r["versions"]] == [0, 1, 2, 3, 4]
    full = r["model"]["full_view_bytes"]
    for v in r["versions"][1:]:
        assert 0 < v["patch_bytes"] < full
    for name, island in r["islands"].items():
        assert island["answers"] >= 1, name
        assert island["final_version"] == 4 and island["versions_loaded"][-1] == 4
        assert island["bytes_fetched"] > 0
    for relay in r["relays"].values():
        assert relay["upstream_bytes"] > 0 and relay["refused"] == 0
        # the WAN is real TCP through rollpatch.netem: payload plus HTTP framing crossed it
        assert relay["link"]["connections"] > 0
        assert relay["link"]["bytes_down"] >= relay["upstream_bytes"]
    assert len(r["reward_curve"]) == 4
    assert sum(r["rollouts"]["used_by_lag"].values()) >= 4 * 32
    for png in ("reward", "versions", "bytes"):
        assert (out / f"{png}.png").stat().st_size > 0
    assert "EMULATED" in proc.stdout
    # a step line is printed as the step publishes: the islands are on an earlier version,
    # each shown with the time that version took to reach it
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 4 and all("just published" in ln for ln in steps), steps
    assert "(in " in steps[-1], steps
    assert not _children_of(str(out)), "a demo process outlived the demo"
    # signed by default: every manifest is an envelope, and it verifies under the run's root
    from rollpatch.board import Board
    from rollpatch.trust import Trust

    assert r["config"]["sign"] is True
    board = Board((out / "board").as_uri(), trust=Trust((out / "trust" / "root.json").read_bytes()))
    assert all(board.signed("demo", n) for n in range(5))
    assert board.latest("demo").version == 4 and board.manifest("demo", 4).version == 4


def test_demo_moe_carries_and_replays_routing(tmp_path: Path) -> None:
    """``--model moe``: a tiny Qwen3-MoE trained, published and served; every response carried
    its routed experts, labelled, and transformers replays a sample under the labelled version."""
    pytest.importorskip("transformers")
    out = tmp_path / "demo-moe"
    report_path = tmp_path / "moe.json"
    argv = _demo_argv(out, "--model", "moe", "--steps", "2", "--json", str(report_path))
    argv[argv.index("--prompts-per-step") + 1] = "4"
    proc = subprocess.run(
        [*argv, "--verify-samples", "16"], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report_path.read_text())
    assert r["ok"] is True and r["config"]["model"] == "moe"
    assert set(r["invariants"]) == {
        "labels_match_weights",
        "latest_only_advanced",
        "islands_on_latest",
        "fetched_bytes_verified",
        "routing_replays",
    }
    assert all(inv["ok"] is True for inv in r["invariants"].values()), r["invariants"]
    rt = r["routing"]
    assert rt["model"] == {"moe_layers": 2, "experts": 8, "top_k": 2}
    assert rt["responses"] == rt["with_routed_experts"] == r["rollouts"]["total"] > 0
    assert rt["problems"] == 0 and rt["replay_mismatches"] == 0
    assert rt["replayed"] >= 3 and rt["replayed_tokens"] >= 3 * rt["replayed"]
    assert sum(d["responses"] for d in rt["by_version"].values()) == rt["responses"]
    for shape, n in rt["shapes"].items():
        tokens, layers, k = map(int, shape.split("x"))
        assert tokens >= 2 and (layers, k) == (2, 2) and n > 0
    assert "routed_experts in" in proc.stdout and "[PASS] routing_replays" in proc.stdout
    assert not _children_of(str(out)), "a demo process outlived the demo"


@pytest.mark.slow
def test_demo_interrupt_stops_every_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "demo-int"
    proc = subprocess.Popen(
        _demo_argv(out, "--steps", "200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # interrupt in the middle of training
            if line.startswith("step   2/"):
                break
        assert len(_children_of(str(out))) >= 5  # trainer, relays, three islands
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    assert not _children_of(str(out))
