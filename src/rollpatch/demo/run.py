"""The orchestrator: start every process, watch the run, check it, report.

Processes (all on 127.0.0.1, free ports)::

    trainer ──publish──> board (file://OUT/board) ──────────────> island "local"
                           │ origin relay ── rollpatch.netem link (emulated WAN, real TCP)
                           ├──> relay "eu" ──> island "eu"
                           └──> relay "us" ──> island "us"
    trainer's rollout workers ──> gateway (this process) ──> the islands' sidecars

The trainer, the relay process and each island are child processes; the gateway, the
monitor and the live view run here. Every child is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import RollpatchError
from .config import ISLANDS, RUN, DemoConfig
from .layout import Layout
from .live import LiveView
from .monitor import Monitor
from .procs import ChildError, ProcessGroup
from .report import build_report, check_invariants, summary_table, write_plots

__all__ = ["DemoFailed", "run_demo"]

_SETUP_TIMEOUT_S = 300.0
_TRAIN_IDLE_TIMEOUT_S = 300.0
#: How long an island may keep failing to boot (its follower retrying) before the demo stops.
_BOOT_ERROR_GRACE_S = 20.0


class DemoFailed(RollpatchError):
    """The demo ran, but an invariant failed (details in the report)."""


#: What each regime is, said at the start of every run (docs/demo.md).
_REGIMES = {
    "fast": (
        "regime fast (lr {lr:g}): a from-scratch policy that only learned the answer "
        "format, at a learning rate ~100x RL post-training's, so the reward climbs within "
        "a few minutes; the price is dense steps (~50% of the BF16 values change, patches "
        "~16% of the view). --regime real shows post-training density."
    ),
    "real": (
        "regime real (lr {lr:g}): RL at a post-training learning rate on a policy "
        "warmed up by an unpublished supervised phase: a few % of the BF16 values change "
        "per step and patches are a few % of the view; on this 0.4M-parameter model the "
        "reward moves slowly (real models are far wider). --regime fast climbs quickly."
    ),
}


def _interrupt(_: int, __: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; returns the report. Raises :class:`DemoFailed` when an invariant
    fails, :class:`ChildError` when a process fails, KeyboardInterrupt on Ctrl-C/SIGTERM."""
    _preflight(cfg)
    layout = Layout(Path(cfg.out))
    layout.prepare()
    procs = ProcessGroup(layout.logs)
    links = [
        (name, "board (file://, direct)" if region is None else f"relay {region} ← emulated WAN")
        for name, region in ISLANDS
    ]
    monitor = Monitor(cfg, layout.board_uri, links)
    view = LiveView(monitor, cfg.live)
    # Ctrl-C and SIGTERM unwind through the finally below, which stops every child (SIGINT
    # is set explicitly: a shell may start background jobs with it ignored)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    gateway: Any = None
    stop_polls = None
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        view.say(
            f"rollpatch demo: output in {layout.root}/ (logs in {layout.logs}/); "
            f"the WAN between the board and the remote relays is EMULATED "
            f"({cfg.wan_mbps:g} Mbit/s, +{cfg.wan_latency_ms:g} ms round trip; real TCP "
            "through rollpatch.netem on loopback)"
        )
        regions = [r for _, r in ISLANDS if r is not None]
        if cfg.sign:
            layout.make_trust()
        trust = ["--trust", str(layout.trust_root)] if cfg.sign else []
        procs.spawn(
            "relays",
            "relays",
            "--board",
            layout.board_uri,
            "--regions",
            ",".join(regions),
            "--cache-root",
            str(layout.root / "relay-cache"),
            "--mbps",
            str(cfg.wan_mbps),
            "--latency-ms",
            str(cfg.wan_latency_ms),
            *trust,
        )
        trainer = procs.spawn(
            "trainer", "trainer", "--config", cfg.to_json(), "--out", str(layout.root)
        )
        for _ in regions:
            ev = procs.wait_for("relays", "listening", _SETUP_TIMEOUT_S)
            monitor.relay(ev["relay"]).url = ev["url"]
        view.say(_REGIMES[cfg.regime].format(lr=cfg.rl_lr))
        view.say("making the tiny model, warming it up (unpublished), publishing v0 ...")
        ready = procs.wait_for("trainer", "ready", _SETUP_TIMEOUT_S, monitor.on_event)
        monitor.on_event("trainer", ready)
        view.say(
            f"model: {ready['params']:,} parameters, served view "
            f"{ready['full_view_bytes']:,} bytes ({cfg.format}); starting 3 islands ..."
        )
        _start_islands(cfg, layout, procs, monitor)
        gateway = _start_gateway(monitor)
        stop_polls = monitor.start_polling()
        timings["setup_s"] = time.monotonic() - t0
        view.say(
            f"gateway {gateway.url} over {len(ISLANDS)} islands; training "
            f"{cfg.steps} steps (max_lag {cfg.max_lag}) ..."
        )
        trainer.send(cmd="go", gateway=gateway.url)
        t_train = time.monotonic()
        _pump_until(procs, monitor, view, lambda: monitor.trained is not None)
        timings["train_s"] = time.monotonic() - t_train
        t_catch = time.monotonic()
        _catch_up(cfg, procs, monitor, view)
        timings["catchup_s"] = time.monotonic() - t_catch
        if cfg.engine == "reference" and monitor.verified is None:
            n = (monitor.trained or {}).get("rollouts", 0)
            check = "all" if cfg.verify_samples == 0 else f"{cfg.verify_samples} of the"
            view.say(
                f"verifying: re-generating {check} {n} rollouts, each under the version "
                "it was labelled with, on one CPU thread ..."
            )
        _pump_until(procs, monitor, view, lambda: monitor.verified is not None)
        timings["verify_s"] = (
            float(monitor.verified.get("verify_s", 0.0)) if monitor.verified else 0.0
        )
        monitor.poll(_client())  # final counters
        view.close()
    finally:
        if stop_polls is not None:
            stop_polls.set()
        if gateway is not None:
            gateway.stop()
        procs.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    while (item := procs.next_event(0.05)) is not None:  # e.g. the relays' final counters
        monitor.on_event(*item)
    timings["total_s"] = time.monotonic() - t0
    invariants = check_invariants(monitor)
    report = build_report(monitor, invariants, timings)
    _write(report, monitor, layout, cfg, view)
    if not report["ok"]:
        failed = [k for k, v in invariants.items() if v["ok"] is False]
        raise DemoFailed("demo invariants failed: " + ", ".join(failed), report=str(layout.summary))
    return report


def _preflight(cfg: DemoConfig) -> None:
    """Fail before starting anything when a needed piece is missing."""
    try:
        from .. import gateway  # noqa: F401
    except ImportError as e:
        raise RollpatchError(f"rollpatch.gateway is not available: {e}") from None
    if cfg.engine == "vllm":
        import importlib

        mod = importlib.import_module("rollpatch.engines.vllm")
        if not hasattr(mod, "VllmEngine"):
            raise RollpatchError(
                "--engine vllm: the vLLM adapter (rollpatch.engines.vllm."
                "VllmEngine) is not available in this build",
                hint="use --engine reference",
            )


def _start_islands(cfg: DemoConfig, layout: Layout, procs: ProcessGroup, monitor: Monitor) -> None:
    for i, (name, region) in enumerate(ISLANDS):
        board = layout.board_uri if region is None else monitor.relay(region).url
        args = [
            "--name",
            name,
            "--board",
            str(board),
            "--run",
            RUN,
            "--model",
            str(layout.model),
            "--format",
            cfg.format,
            "--engine",
            cfg.engine,
            "--poll",
            str(cfg.poll_s),
        ]
        if cfg.sign:
            args += [
                "--trust",
                str(layout.trust_root),
                "--trust-state",
                str(layout.trust_state(f"island-{name}")),
            ]
        if cfg.engine == "vllm":
            args += ["--engine-url", cfg.engine_urls[i]]
        procs.spawn(f"island-{name}", "island", *args)
    urls: dict[str, str] = {}
    for name, _ in ISLANDS:
        ev = procs.wait_for(f"island-{name}", "listening", _SETUP_TIMEOUT_S, monitor.on_event)
        monitor.islands[name].url = urls[name] = str(ev["url"])
    client = _client()
    t0 = time.monotonic()
    for name, _ in ISLANDS:  # ready = v0 loaded and verified
        url = urls[name]
        while not _ready(client, url):
            error = _last_error(client, url)
            waited = time.monotonic() - t0
            if waited > _SETUP_TIMEOUT_S or (error and waited > _BOOT_ERROR_GRACE_S):
                raise ChildError(
                    f"island {name} could not load version 0: {error or 'timed out'}",
                    log=str(procs.logs / f"island-{name}.log"),
                )
            item = procs.next_event(0.2)
            if item is not None:
                procs.check(*item)
                monitor.on_event(*item)


def _ready(client: Any, url: str) -> bool:
    import httpx

    try:
        return bool(client.get(f"{url}/ready").status_code == 200)
    except httpx.HTTPError:  # busy booting (a slow link can hold its event loop): not yet
        return False


def _last_error(client: Any, url: str) -> str | None:
    import httpx

    try:
        error = client.get(f"{url}/version").json().get("last_error")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(error) if error else None


def _start_gateway(monitor: Monitor) -> Any:
    from ..gateway import start_gateway

    return start_gateway(
        [f"{i.name}={i.url}" for i in monitor.islands.values()], log_level="warning"
    )


def _client() -> Any:
    import httpx

    return httpx.Client(timeout=5.0)


def _pump_until(
    procs: ProcessGroup,
    monitor: Monitor,
    view: LiveView,
    done: Any,
    timeout: float = _TRAIN_IDLE_TIMEOUT_S,
) -> None:
    """Fold events into the monitor and redraw, until ``done()``; fail if nothing happens
    for ``timeout`` seconds."""
    last_event = time.monotonic()
    last_draw = 0.0
    while not done():
        item = procs.next_event(0.1)
        now = time.monotonic()
        if item is not None:
            procs.check(*item)
            if item[1]["ev"] == "exit":
                raise ChildError(f"{item[0]} exited unexpectedly")
            monitor.on_event(*item)
            last_event = now
        elif now - last_event > timeout:
            raise ChildError("no progress for too long", idle_s=timeout)
        if now - last_draw >= 0.5 or (item is not None and item[1]["ev"] == "step"):
            view.refresh()
            last_draw = now


def _catch_up(cfg: DemoConfig, procs: ProcessGroup, monitor: Monitor, view: LiveView) -> None:
    """After the last step, wait for every island to commit LATEST (the final catch-up)."""
    final = monitor.latest
    deadline = time.monotonic() + cfg.catchup_timeout_s

    def caught_up() -> bool:
        return (
            all(i.served == final for i in monitor.islands.values()) or time.monotonic() > deadline
        )

    _pump_until(procs, monitor, view, caught_up)


def _write(
    report: dict[str, Any], monitor: Monitor, layout: Layout, cfg: DemoConfig, view: LiveView
) -> None:
    text = json.dumps(report, indent=1)
    layout.summary.write_text(text)
    if cfg.json_path:
        Path(cfg.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_path).write_text(text)
    try:
        plots = write_plots(report, monitor, layout.root)
        plot_note = "plots: " + ", ".join(str(p) for p in plots)
    except ImportError:
        plot_note = "plots skipped: matplotlib is not installed (pip install matplotlib)"
    view.say(summary_table(report))
    view.say(
        f"\nreport: {layout.summary}"
        + (f" and {cfg.json_path}" if cfg.json_path else "")
        + f"\n{plot_note}"
    )
