"""Subprocesses of ``bench/peers.py``: islands, the emulated link, shardcast's middle node.

``python bench/_peers_island.py JOB_JSON``. Every process writes JSON lines on stdout
(``{"event": ...}``; logs go to stderr) and stops when its stdin closes, so the driver never
has to signal it. Events: ``ready`` (holding v0 / listening), ``serving`` (``version`` and
wall-clock ``t``: the island serves that version's bits from now on), ``stats`` (the link's
counters, on a ``stats`` line in stdin), ``done`` (peak RSS since ``ready``, final check).

Islands start holding v0 (loaded from the driver's file, untimed) and then follow the
method's own path to each version:

- ``rollpatch``: a :class:`Follower` over the region's relay into a :class:`ViewEngine`
  (fetch, verify, stage, commit: the verified commit is the serving moment);
- ``xor``: polls the same board through the same relay, fetches the version's XZ1 object
  (BLAKE3-checked by the board), XORs it in place and checks each tensor's xxh3-128;
- ``shardcast``: shardcast's own ``ClientNode.download_version`` from the middle node
  (shards over HTTP with wget, reassembly, whole-file BLAKE3), then loads the file.

At ``done`` every island recomputes its view's root digest from the words and compares it
with the digest the driver computed from the simulator; a mismatch is reported, never hidden.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _util import peak_rss, reset_peak_rss

from rollpatch.follower.watch import WakeEvent

_stop = WakeEvent()
_lines: list[str] = []
_lines_cond = threading.Condition()


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _stdin() -> None:
    for line in sys.stdin:
        with _lines_cond:
            _lines.append(line.strip())
            _lines_cond.notify_all()
    _stop.set()
    with _lines_cond:
        _lines_cond.notify_all()


def fresh_digest(view: Any) -> str:
    from rollpatch.view import root_digest

    return root_digest({name: t.digest() for name, t in view.items()})


def _done(view: Any, job: dict[str, Any], have: int, **extra: Any) -> None:
    want = int(job["last"])
    ok = have == want and fresh_digest(view) == job["expected"][str(want)]
    emit("done", peak=peak_rss(), have=have, bit_exact=ok, **extra)


# -- islands -----------------------------------------------------------------------------------


def _serving_view() -> type:
    from rollpatch.engines.view_engine import ViewEngine
    from rollpatch.patch import apply

    class ServingView(ViewEngine):
        """The island's engine (``--island-commit incremental``): a view whose commit checks
        the target digests in O(change) — each touched tensor's rp.sum128 state updated from
        the words written — as the serving engines commit (docs/engines.md, "Staging and the
        pause"), instead of re-hashing every touched tensor (here: nearly all 201 MB) inside
        the pause. The island's final check re-hashes every word (``ViewEngine`` has no
        ``audit()``: the follower's background audit does nothing here)."""

        def apply(self, patch: Any, version: int) -> None:
            with self._lock:
                apply(self.view, patch, incremental=True)  # verified; rolled back on mismatch
                self._version = version

    return ServingView


def _ServingView() -> Any:
    return _serving_view()()


def _fused_view() -> Any:
    from rollpatch.engines.staged import StagedUpdate
    from rollpatch.errors import BaseMismatchError
    from rollpatch.patch.inplace import apply_encoded

    class FusedView(_serving_view()):  # type: ignore[misc]
        """The island's engine under ``--island-commit fused``: a one-step, one-object update
        is handed over encoded (the follower fetched it and checked its BLAKE3 against the
        signed manifest) and decoded straight into the live words by ``apply_encoded`` (one
        native pass per chunk, the old words read from the very words overwritten; targets
        checked in O(change); all or nothing) — inside the pause, as the XOR islands write
        theirs. Nothing is staged while serving; chains and sharded steps fall back to the
        follower's decode (staged, then :meth:`apply`)."""

        def stage_encoded(self, steps: Any, version: int) -> Any:
            if len(steps) != 1 or len(steps[0].blobs) != 1:
                return None
            if steps[0].base != self.view.digest():
                raise BaseMismatchError("the step does not start at the held version")
            return StagedUpdate(steps[0].base, steps[0].target, {}, {}, {"blob": steps[0].blobs[0]})

        def commit_staged(self, staged: Any, version: int) -> None:
            blob = staged.payload.pop("blob")
            with self._lock:
                if self.view.digest() != staged.base:
                    raise BaseMismatchError("the engine moved since the update was staged")
                apply_encoded(self.view, blob, incremental=True)  # checks the patch's target
                self._version = version

    return FusedView()


ENGINES = {"full": lambda: _view_engine(), "incremental": _ServingView, "fused": _fused_view}


def _view_engine() -> Any:
    from rollpatch.engines.view_engine import ViewEngine

    return ViewEngine()


def island_rollpatch(job: dict[str, Any]) -> None:
    from _peers_trace import TracingStore, run_delay

    from rollpatch.board import Board
    from rollpatch.follower import Follower, FollowerConfig
    from rollpatch.io.safetensors import load_view
    from rollpatch.store import open_store

    engine = ENGINES[job.get("commit", "incremental")]()
    engine.load(load_view(job["v0"]), 0)
    tracer = TracingStore(open_store(job["board"]))
    follower = Follower(
        Board(tracer), job["run"], engine, FollowerConfig(poll_s=job["poll_s"], timeout_s=600.0)
    )

    def serving(v: int, pause: float) -> None:
        t = time.time()
        trace, delay = tracer.take(), run_delay() - tracer.delay_at_notice
        emit("serving", version=v, t=t, pause_s=pause, trace=trace, run_delay_s=delay)

    follower.on_commit.append(serving)
    if follower.sync(0) != 0:
        raise SystemExit("rollpatch island: v0 not verified")
    reset_peak_rss()
    emit("ready", version=0)
    follower.start()
    _stop.wait()
    follower.stop()
    st = follower.status()
    _done(
        engine.view,
        job,
        follower.version or -1,
        bytes_fetched=st.bytes_fetched,
        error=st.last_error,
    )


def island_xor(job: dict[str, Any]) -> None:
    from _peers_trace import TracingStore, run_delay
    from _peers_xor import apply_blob

    from rollpatch.board import Board
    from rollpatch.follower import FollowerConfig
    from rollpatch.follower.watch import LatestHint
    from rollpatch.io.safetensors import load_view
    from rollpatch.store import open_store

    view = load_view(job["v0"])
    tracer = TracingStore(open_store(job["board"]))
    board = Board(tracer)
    have, fetched = 0, 0
    from rollpatch.native import threads

    pool = ThreadPoolExecutor(threads())  # what rollpatch's islands decode with
    # the same notice as rollpatch's followers: the new version's manifest and step patch
    # come in the long-poll's answer (FollowerConfig's push_bytes)
    hint = LatestHint(tracer, job["run"], push_bytes=FollowerConfig().push_bytes)
    _stop.on_set.append(hint.cancel)
    reset_peak_rss()
    emit("ready", version=0)
    while not _stop.is_set():
        p = board.latest(job["run"])
        if p is None or p.version <= have:
            hint.wait(have, job["poll_s"], _stop)
            continue
        for v in range(have + 1, p.version + 1):
            (po,) = board.manifest(job["run"], v).patches_from(v - 1)
            blob = board.fetch(po.ref)
            fetched += len(blob)
            apply_blob(view, blob, pool)
            del blob
            have = v
            t, delay = time.time(), run_delay() - tracer.delay_at_notice
            emit("serving", version=v, t=t, trace=tracer.take(), run_delay_s=delay)
    pool.shutdown()
    _done(view, job, have, bytes_fetched=fetched)


def island_shardcast(job: dict[str, Any]) -> None:
    from shardcast.client_node import ClientNode
    from shardcast.envs import SHARDCAST_DISTRIBUTION_FILE

    from rollpatch.io.safetensors import load_view

    work = Path(job["dir"])
    client = ClientNode([job["server"]], str(work))
    dl = client.downloader

    def distribution() -> str | None:
        # shardcast writes this temp file next to its package, shared by every client on the
        # machine; clients on separate machines do not race on it, so each island has its own
        tmp = str(work / "distribution.txt")
        if dl.download_file(
            SHARDCAST_DISTRIBUTION_FILE, tmp, update_metrics=False, log_error_on_failure=False
        ):
            text = Path(tmp).read_text()
            os.unlink(tmp)
            return text
        return None

    dl.download_distribution_file = distribution  # type: ignore[method-assign]
    view = load_view(job["v0"])
    have = 0
    middle = Path(job["middle_dir"])
    reset_peak_rss()
    emit("ready", version=0)
    while not _stop.is_set():
        name = f"v{have + 1}"
        if not _middle_complete(middle, name):
            _stop.wait(job["poll_s"])
            continue
        out = work / f"{name}.safetensors"
        path = client.download_version(name, str(out))
        if path is None:
            raise SystemExit(f"shardcast island: download of {name} failed")
        del view
        view = load_view(path)  # the engine loads the checkpoint it received
        os.unlink(path)
        have += 1
        emit("serving", version=have, t=time.time())
    _done(view, job, have)


def _middle_complete(middle: Path, name: str) -> bool:
    """Whether the middle node holds every shard of ``name`` (shards are renamed into place
    when complete). Real clients cannot look: they poll the middle's distribution file,
    which the middle writes *before* its shards arrive, and retry 404s after 2 s; the bench
    spares shardcast that wait by starting clients only once the middle is complete."""
    try:
        lines = (middle / "distribution.txt").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        v, _, info = line.partition(":")
        if v.strip() == name:
            count = int(info.strip().partition("|")[2] or 0)
            return count > 0 and all(
                (middle / name / f"shard_{i + 1:05d}.bin").exists() for i in range(count)
            )
    return False


# -- infrastructure ----------------------------------------------------------------------------


def link(job: dict[str, Any]) -> None:
    from rollpatch.netem import Link, LinkConfig

    cfg = LinkConfig(
        upstream=tuple(job["upstream"]),
        latency_ms=job["latency_ms"],
        mbps=job["mbps"],
        loss=job.get("loss", 0.0),
        seed=0,
    )
    with Link(cfg) as lk:
        emit("ready", port=lk.port)
        seen = 0
        while True:
            with _lines_cond:
                while len(_lines) == seen and not _stop.is_set():
                    _lines_cond.wait()
                if len(_lines) == seen:
                    break
                seen = len(_lines)
            s = lk.stats()
            emit(
                "stats",
                bytes_up=s.bytes_up,
                bytes_down=s.bytes_down,
                connections=s.connections,
                t=time.time(),
            )
    emit("done", peak=peak_rss())


def middle(job: dict[str, Any]) -> None:
    from shardcast.middle_node import MiddleNode

    node = MiddleNode(
        [job["upstream"]], job["dir"], job["port"], check_interval=job["check_interval"]
    )
    reset_peak_rss()
    emit("ready", port=job["port"])
    _stop.wait()
    node.shutdown()
    emit("done", peak=peak_rss())


MODES = {
    "rollpatch": island_rollpatch,
    "xor": island_xor,
    "shardcast": island_shardcast,
    "link": link,
    "middle": middle,
}


def main() -> int:
    job = json.loads(sys.argv[1])
    threading.Thread(target=_stdin, daemon=True).start()
    MODES[job["mode"]](job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
