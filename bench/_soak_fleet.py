"""The soak's fleet: processes, the board they share, and the faults injected into them."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _soak_faults import Faults
from _soak_procs import RUN, Proc, S3Board, free_port, rollpatch

HERE = Path(__file__).resolve().parent
#: In order; ``corrupt`` last: a follower that cannot route around a corrupted object stays
#: behind, and would mask how the fleet recovers from the others.
FAULTS = ("relay-restart", "store-outage", "forged", "sidecar-kill", "publisher-kill", "corrupt")
RECOVERY_LIMIT_S = 120.0


class Fleet(Faults):
    """Publisher, relay, islands ``a`` (store) and ``b`` (relay), gateway: all processes."""

    def __init__(self, workdir: Path, *, lag: int) -> None:
        self.workdir, self.lag = workdir, lag
        self.procs: dict[str, Proc] = {}
        self.samples: dict[str, list[tuple[float, int, int, int]]] = {}
        self.latest_log: list[tuple[float, int]] = []
        self.first_version: int | None = None
        self._stop = threading.Event()
        self.board: S3Board | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        from rollpatch.engines.reference import make_tiny_model
        from rollpatch.trust import Root, sign_root, write_keypair

        w = self.workdir
        self.model = make_tiny_model(w / "model", seed=0)
        self.model_name = "model"
        key_path, _pub_path, key = write_keypair(w / "publisher")
        self.root = w / "root.json"
        self.root.write_bytes(sign_root(Root.new([key.public]), [key]))
        self.board = S3Board(w)
        env = self.board.env
        ports = {n: free_port() for n in ("relay", "a", "b", "gateway")}
        url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        self.gateway_url = url["gateway"]
        self.island_urls = {n: url[n] for n in ("a", "b")}
        self.procs["publisher"] = Proc(
            "publisher",
            [
                sys.executable,
                str(HERE / "_soak_procs.py"),
                self.board.uri,
                str(self.model),
                str(key_path),
                "1.0",
            ],
            w,
            env,
            None,
        )
        self.procs["relay"] = Proc(
            "relay",
            rollpatch(
                "relay",
                "--board",
                self.board.uri,
                "--cache",
                str(w / "relay-cache"),
                "--port",
                str(ports["relay"]),
                "--trust",
                str(self.root),
                "--pointer-ttl",
                "0.2",
                "--list-ttl",
                "0.5",
                "--log-level",
                "warning",
            ),
            w,
            env,
            f"{url['relay']}/health",
        )
        for name, board in (("a", self.board.uri), ("b", url["relay"])):
            self.procs[name] = Proc(
                name,
                rollpatch(
                    "sidecar",
                    "--board",
                    board,
                    "--run",
                    RUN,
                    "--engine",
                    "reference",
                    "--model",
                    str(self.model),
                    "--port",
                    str(ports[name]),
                    "--poll",
                    "0.2",
                    "--threads",
                    "1",
                    "--trust",
                    str(self.root),
                    "--trust-state",
                    str(w / f"trust-{name}.json"),
                ),
                w,
                env,
                f"{url[name]}/health",
            )
        self.procs["gateway"] = Proc(
            "gateway",
            rollpatch(
                "gateway",
                "--sidecar",
                f"a={url['a']}",
                "--sidecar",
                f"b={url['b']}",
                "--port",
                str(ports["gateway"]),
                "--poll",
                "0.2",
            ),
            w,
            env,
            f"{url['gateway']}/health",
        )
        # the relay boots while the publisher makes its first version; then the islands and
        # the gateway boot at once (each loads torch and the model: one after the other, they
        # took most of the set-up). The relay answers before island b reads through it.
        self.procs["publisher"].start()
        self.procs["relay"].spawn()
        threading.Thread(target=self._watch_latest, daemon=True).start()
        self._until(lambda: self.latest() is not None, "the first version", 120)
        self.procs["publisher"].ready_at = time.monotonic()
        self.first_version = self.latest()
        self.procs["relay"].wait_ready()
        for name in ("a", "b", "gateway"):
            self.procs[name].spawn()
        for name in ("a", "b", "gateway"):
            self.procs[name].wait_ready()
        self._until(self.recovered, "the fleet to serve", 180)

    def stop(self) -> None:
        self._stop.set()
        names = [n for n in ("gateway", "a", "b", "relay", "publisher") if n in self.procs]
        for name in names:  # every process shuts down at once, each then waited for
            self.procs[name].terminate()
        for name in names:
            self.procs[name].stop()
        if self.board is not None:
            self.board.stop()

    # -- observation ---------------------------------------------------------------------------

    def _watch_latest(self) -> None:
        """LATEST as the trainer's side sees it, read directly (verified), every 0.1 s."""
        from rollpatch.board import Board
        from rollpatch.errors import RollpatchError
        from rollpatch.store import open_store
        from rollpatch.trust import Trust

        assert self.board is not None
        store = open_store(
            self.board.uri,
            endpoint_url=f"http://127.0.0.1:{self.board.port}",
            access_key_id="soak",
            secret_access_key="soak",
            region="us-east-1",
        )
        board = Board(store, trust=Trust(self.root.read_bytes()))
        while not self._stop.is_set():
            try:
                p = board.latest(RUN)
                if p is not None and (not self.latest_log or p.version > self.latest_log[-1][1]):
                    self.latest_log.append((time.monotonic(), p.version))
            except RollpatchError:
                pass  # a forged LATEST: refused (the publisher replaces it)
            self._stop.wait(0.1)

    def latest(self) -> int | None:
        return self.latest_log[-1][1] if self.latest_log else None

    def sample_loop(self, stop: threading.Event, warmup_s: float = 20.0) -> None:
        """RSS and open files of every process every 2 s, from ``warmup_s`` into the load
        (its client connections are open by then: not growth)."""
        stop.wait(warmup_s)
        while not stop.is_set():
            for name, proc in self.procs.items():
                s = proc.sample()
                # from 5 s after the process became ready: start-up is not growth
                if (
                    s is not None
                    and proc.pid is not None
                    and proc.ready_at is not None
                    and time.monotonic() > proc.ready_at + 5
                ):
                    self.samples.setdefault(name, []).append((time.monotonic(), proc.pid, *s))
            stop.wait(2.0)

    def islands(self) -> dict[str, dict[str, Any]] | None:
        try:
            body = httpx.get(f"{self.gateway_url}/islands", timeout=5).json()
            return {i["name"]: i for i in body["islands"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def recovered(self, since: dict[str, int] | None = None) -> bool:
        """Every island is reachable and serving, has committed a version newer than it
        served in ``since`` (its follower works again; an overloaded machine may keep it a few
        versions behind LATEST), and a ``max_lag`` probe through the gateway is answered."""
        islands = self.islands()
        if islands is None or not all(
            i["reachable"] and i["served"] is not None for i in islands.values()
        ):
            return False
        if since is not None and any(
            islands[n]["served"] <= v for n, v in since.items() if n in islands
        ):
            return False
        try:
            r = httpx.post(
                f"{self.gateway_url}/v1/completions",
                timeout=30,
                json={
                    "model": self.model_name,
                    "prompt": "1 + 1 =",
                    "max_tokens": 1,
                    "rollpatch": {"max_lag": self.lag, "wait_s": 5},
                },
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _until(self, cond: Any, what: str, limit: float) -> float | None:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > limit:
                return None
            time.sleep(0.2)
        return time.monotonic() - t0

    # -- faults --------------------------------------------------------------------------------

    def inject(self, fault: str, load: Any) -> dict[str, Any]:
        """Inject ``fault``; recovery is counted from when the fault ends (the service is
        restarted or the store is back), until :meth:`recovered` (and, after the publisher's
        crash, until it has published again)."""
        at = time.monotonic()
        before = self.latest() or 0
        note = getattr(self, "_" + fault.replace("-", "_"))()
        held = time.monotonic() - at

        after = self.islands() or {}
        since = {n: (i["served"] or -1) for n, i in after.items()}

        def done() -> bool:
            moved = fault != "publisher-kill" or (self.latest() or 0) > before
            return moved and self.recovered(since)

        recovery = self._until(done, f"recovery from {fault}", RECOVERY_LIMIT_S)
        if fault in ("publisher-kill", "corrupt"):  # both restart the publisher
            self.procs["publisher"].ready_at = time.monotonic()
        end = time.monotonic()
        out = {
            "fault": fault,
            "at": at,
            "held_s": held,
            "end": end,
            "recovery_s": None if recovery is None else round(recovery, 1),
            "note": note,
        }
        if recovery is None:  # what each island says of itself: the cause, for the report
            out["state"] = {"latest": self.latest(), "since": since, **self.island_states()}
        return out

    def island_states(self) -> dict[str, Any]:
        """Each island's ``/version`` (version, lag, follower state, last error), as JSON."""
        out: dict[str, Any] = {}
        for name, url in self.island_urls.items():
            try:
                out[name] = httpx.get(f"{url}/version", timeout=10).json()
            except (httpx.HTTPError, ValueError) as e:
                out[name] = f"{type(e).__name__}: {e}"
        return out
