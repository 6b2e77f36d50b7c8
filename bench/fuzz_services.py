"""Hostile-input campaign against the services and their parsers (issue 11).

Run: ``python bench/fuzz_services.py`` (60 s per atheris target, 1,500 schemathesis cases per
operation mode and service), ``--seconds 5 --cases 100`` for a short run.

**atheris** (coverage-guided, libFuzzer inside CPython; rollpatch's modules instrumented): one
process per target in ``bench/_fuzz_targets.py``, each forked from one process that
imported and instrumented rollpatch once — signed and bare manifests, LATEST (signed
and bare), trust roots, safetensors headers, relay cache files, sidecar/gateway request bodies
(strict JSON → typed model → constraint), what a hostile island answers the gateway. Seeds are
real documents from a signed board. A crash is any exception other than a RollpatchError
refusal; a hang is an input over ``-timeout`` (10 s); memory is capped (``-rss_limit_mb``).

**schemathesis** against the OpenAPI documents of a real sidecar (built-in engine, tiny
model, a published version), a gateway in front of it and a relay of the board, over loopback
sockets: every operation, positive (schema-valid) and negative (schema-violating) cases. A
failure is a 500, no answer within 60 s (hang), a 4xx whose body is not a JSON error, or an
ERROR log record (a traceback) from any server; afterwards a real completion must still be
served with its version label, and the sidecar must hold no admission slot.

Prints one table (and ``--json``); exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _util import log, table

WORK = HERE.parent / "build" / "fuzz-services"


@dataclass
class Row:
    campaign: str
    target: str
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    detail: str = ""
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.crashes == 0 and self.hangs == 0 and self.inputs > 0


# -- atheris ---------------------------------------------------------------------------------


def _instrument() -> None:
    """Import rollpatch's parsers instrumented for coverage (about 6 s of CPU: once per
    campaign, in the fork server)."""
    import atheris

    with atheris.instrument_imports(include=["rollpatch"]):
        import rollpatch.gateway.proxy
        import rollpatch.io.safetensors
        import rollpatch.jsonsafe
        import rollpatch.latest
        import rollpatch.manifest
        import rollpatch.relay.cache
        import rollpatch.serving.body
        import rollpatch.serving.schema
        import rollpatch.sidecar.protocol
        import rollpatch.trust  # noqa: F401


def _child(name: str, seconds: int, workdir: Path) -> None:
    """Runs inside the fuzzing process, after :func:`_instrument` (never returns: libFuzzer
    exits)."""
    import _fuzz_targets
    import atheris

    fn, seeds = _fuzz_targets.targets(_fuzz_targets.Env())[name]
    corpus = workdir / f"corpus-{name}"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    atheris.Setup(
        [
            sys.argv[0],
            f"-max_total_time={seconds}",
            "-timeout=10",
            "-rss_limit_mb=3072",
            "-max_len=65536",
            "-print_final_stats=1",
            f"-artifact_prefix={workdir}/{name}-",
            str(corpus),
        ],
        fn,
    )
    atheris.Fuzz()


def _fork_server(names: list[str], seconds: int, logs: Path) -> None:
    """Instrument once, then fuzz each target in a process forked from this one (libFuzzer
    runs once per process and exits), one after the other, as separate processes did before
    (each a fresh interpreter instrumenting rollpatch again). Each target's output goes to
    ``logs/NAME.log``; one JSON line per target on stdout: its exit status (None: killed
    after ``seconds + 300`` s)."""
    _instrument()
    for name in names:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the fuzzing process: its own Env, corpus and libFuzzer
            try:
                fd = os.open(logs / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _child(name, seconds, WORK)
            except BaseException:  # noqa: BLE001 (any: its traceback, then a crash status)
                traceback.print_exc()
            finally:
                os._exit(70)  # _child raised (its traceback is in the log): a crash
        rc = _wait(pid, seconds + 300)
        print(json.dumps({"target": name, "rc": rc}), flush=True)


def _wait(pid: int, limit: float) -> int | None:
    """The exit status of ``pid`` (negative: a signal), or None after ``limit`` s (killed)."""
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def _stat(text: str, name: str) -> int:
    m = re.findall(rf"stat::{name}:\s+(\d+)", text)
    return int(m[-1]) if m else 0


def run_atheris(names: list[str], seconds: int) -> list[Row]:
    WORK.mkdir(parents=True, exist_ok=True)
    log(f"atheris: {', '.join(names)}, {seconds} s each (one instrumented fork server)")
    with tempfile.TemporaryDirectory(prefix="fuzz-services-") as tmp:
        logs = Path(tmp)
        server = subprocess.run(
            [sys.executable, __file__, "--child", ",".join(names), "--seconds", str(seconds)]
            + ["--logs", str(logs)],
            check=False,
            capture_output=True,
            text=True,
            timeout=len(names) * (seconds + 300) + 120,
            cwd=HERE,
        )
        status: dict[str, int | None] = {}
        for line in server.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                status[rec["target"]] = rec["rc"]
        rows = []
        for name in names:
            path = logs / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            rows.append(_row(name, text, status.get(name, "missing"), server))
    return rows


def _row(
    name: str, text: str, rc: int | None | str, server: subprocess.CompletedProcess[str]
) -> Row:
    """One target's row from its libFuzzer output and exit status (``None``: killed after
    its time limit, a hang; ``"missing"``: the fork server died before it ran)."""
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", text)
    row = Row(
        "atheris",
        name,
        inputs=_stat(text, "number_of_executed_units"),
        extra={"cov": int(cov[-1][0]) if cov else 0, "corpus": int(cov[-1][2]) if cov else 0},
    )
    if rc == "missing":
        row.crashes = 1
        row.detail = f"fork server exited {server.returncode} before this target"
        print(server.stderr[-4000:], file=sys.stderr)
    elif rc != 0:
        hang = rc is None or ("timeout" in text.lower() and "Uncaught Python exception" not in text)
        row.hangs, row.crashes = (1, 0) if hang else (0, 1)
        tail = [ln for ln in text.splitlines() if ln.strip()][-25:]
        row.detail = f"exit {rc}; artifacts in {WORK}"
        print("\n".join(tail), file=sys.stderr)
    return row


# -- schemathesis ----------------------------------------------------------------------------


def run_schemathesis(cases: int) -> list[Row]:
    from _fuzz_services_world import World, check_case

    rows = []
    with World(WORK / "world") as world:
        for service, url in world.services().items():
            row = Row("schemathesis", service)
            for op, mode, n, failures, hangs in world.fuzz(url, cases, check_case):
                row.inputs += n
                row.crashes += failures
                row.hangs += hangs
                log(
                    f"schemathesis: {service} {op} {mode}: {n} cases, {failures} failures, "
                    f"{hangs} hangs"
                )
            rows.append(row)
        after = world.after_campaign()
        rows.append(
            Row(
                "schemathesis",
                "ERROR log records (tracebacks)",
                inputs=sum(r.inputs for r in rows),
                crashes=after["errors"],
            )
        )
        rows.append(
            Row(
                "schemathesis",
                "served after the campaign",
                inputs=1,
                crashes=0 if after["served"] else 1,
                detail=f"version {after['version']}, slots held {after['inflight']}",
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=60, help="atheris seconds per target")
    ap.add_argument(
        "--cases", type=int, default=1500, help="schemathesis cases per operation, mode and service"
    )
    ap.add_argument("--only", choices=("atheris", "schemathesis"))
    ap.add_argument("--targets", help="comma-separated atheris targets (default: all)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--logs", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _fork_server(args.child.split(","), args.seconds, args.logs)
        return 0
    from _fuzz_targets import TARGET_NAMES

    t0 = time.time()
    rows: list[Row] = []
    if args.only in (None, "atheris"):
        names = args.targets.split(",") if args.targets else list(TARGET_NAMES)
        rows += run_atheris(names, args.seconds)
    if args.only in (None, "schemathesis"):
        rows += run_schemathesis(args.cases)
    print(
        table(
            ["campaign", "target", "inputs", "crashes/failures", "hangs", "coverage", "note"],
            [
                [
                    r.campaign,
                    r.target,
                    f"{r.inputs:,}",
                    str(r.crashes),
                    str(r.hangs),
                    f"cov {r.extra['cov']}, corpus {r.extra['corpus']}" if r.extra else "",
                    r.detail,
                ]
                for r in rows
            ],
            right=[False, False, True, True, True, False, False],
        )
    )
    hostile = sum(
        r.inputs
        for r in rows
        if r.target not in ("ERROR log records (tracebacks)", "served after the campaign")
    )
    bad = [r for r in rows if not r.ok]
    print(
        f"\n{hostile:,} hostile inputs in {time.time() - t0:.0f} s; "
        f"{sum(r.crashes for r in rows)} crashes/failures, {sum(r.hangs for r in rows)} hangs"
        f" -> {'FAIL' if bad else 'ok'}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
