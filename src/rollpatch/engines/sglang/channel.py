"""The adapter's channels to one SGLang server (stdlib only): its HTTP routes, rollpatch's
commands through the weight-update route, the control socket, scratch files
(:class:`~rollpatch.engines.shared_dir.SharedDir`) and the pause.

:class:`SglangChannel` is the transport half of :class:`~.adapter.SglangEngine`: the adapter
decides what to stage, commit and verify; the channel only carries it (wire formats in
:mod:`.wire`, docs/sglang.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ...errors import EngineError
from ...logs import event
from ..ownership import owner_token
from ..pausing import NestedPause
from ..shared_dir import SharedDir
from . import rendezvous
from .arena import Arena
from .launch import LOADER
from .wire import command_payload, http_json, request, result

_LOG = logging.getLogger("rollpatch.engines.sglang")

__all__ = ["SglangChannel"]


class SglangChannel(NestedPause):
    """HTTP, commands and the control socket of one SGLang server launched with rollpatch's
    loader.

    ``url``: the server (same host: files and a UNIX socket are shared). ``shared_dir``: a
    directory SGLang can read (default: a fresh private one, removed by :meth:`close`).
    ``timeout``: seconds per call. ``lock``: the adapter's lock (pauses nest under it).
    """

    def __init__(
        self,
        url: str,
        *,
        shared_dir: str | Path | None,
        timeout: float,
        lock: threading.RLock,
        token: str | None = None,
    ) -> None:
        self.base_url = url.rstrip("/")
        self.timeout = timeout
        self.token = token  # SGLang's --api-key
        self.scratch = SharedDir(shared_dir, prefix="rollpatch-sglang-")
        self._tag_id = secrets.token_hex(4)
        #: This adapter's token in every call to the loader, which refuses another adapter's
        #: calls while one drives it (one sidecar per engine).
        self.owner = owner_token()
        #: Another adapter took SGLang over (the loader refused a call of this one): what
        #: this one verified is void until it sets a version again.
        self.displaced = False
        self.tp = 1  # SGLang's --tp-size, read at start
        self._started = False
        #: Each rank's loader identity, from the last start (a restarted SGLang: new ones).
        self.boots: tuple[str | None, ...] = ()
        self._session_open = False
        self._shm: SharedDir | None = None  # made at the first shm(): /dev/shm, else scratch
        #: TP > 1: the whole tensors the ranks gather for their owners (:mod:`.arena`).
        self.arena = Arena(self.shm)
        #: Milliseconds spent in each HTTP route since the owner last cleared it (a commit's
        #: profile: the pause's round trips).
        self.route_ms: dict[str, float] = {}
        #: Seconds SGLang was last held: from the pause request to ``/continue_generation``
        #: answered (the outermost pause).
        self.held_s = 0.0
        self._frozen_at = 0.0
        super().__init__(lock)

    @property
    def shared_dir(self) -> Path:
        """The directory shared with SGLang (:attr:`scratch`'s)."""
        return self.scratch.path

    def socket(self, rank: int = 0) -> Path:
        """Rank ``rank``'s control socket (each TP rank runs its own control thread)."""
        return self.shared_dir / f"control-{self._tag_id}-r{rank}.sock"

    def shm(self, what: str) -> Path:
        """A fresh file name in shared memory (a private directory under ``/dev/shm``, else
        the shared directory): tensors gathered from the ranks are mapped there by both
        sides, never written to a disk."""
        if self._shm is None:
            base = Path("/dev/shm")
            self._shm = (
                SharedDir(None, prefix="rollpatch-sglang-", under=base)
                if base.is_dir()
                else self.scratch
            )
        return self._shm.name(what)

    def http(self, method: str, path: str, body: Any = None, *, check: bool = True) -> Any:
        """One JSON call to SGLang's HTTP server (:func:`.wire.http_json`); its time is
        added to :attr:`route_ms` under ``path``."""
        t0 = time.perf_counter()
        try:
            return http_json(
                self.base_url,
                method,
                path,
                body,
                timeout=self.timeout,
                check=check,
                token=self.token,
            )
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            self.route_ms[path] = self.route_ms.get(path, 0.0) + ms

    def tag(self, tag: str) -> None:
        """Set SGLang's ``weight_version`` without aborting requests in flight."""
        # SGLang's default for this route aborts every request in flight: not ours to abort
        self.http(
            "POST", "/update_weight_version", {"new_version": tag, "abort_all_requests": False}
        )

    def start(self) -> None:
        """Check the loader is registered and start its control thread (once)."""
        if not self._started:
            info = self.http("GET", "/server_info")
            if LOADER not in (info.get("custom_weight_loader") or []):
                raise EngineError(
                    "SGLang was not launched with rollpatch's weight loader",
                    engine="sglang",
                    url=self.base_url,
                    hint=f"add --custom-weight-loader {LOADER} (docs/sglang.md)",
                )
            if info.get("sleep_on_idle") is False:
                # idle, SGLang's scheduler then polls its sockets in a loop that holds the
                # GIL, which the control thread staging a patch needs (docs/sglang.md)
                event(
                    _LOG,
                    "sglang_polls_when_idle",
                    logging.WARNING,
                    url=self.base_url,
                    hint="launch SGLang with --sleep-on-idle: staging beside the polling "
                    "loop took about 13x as long (docs/sglang.md, Staging beside an idle "
                    "scheduler)",
                )
            self.tp = int(info.get("tp_size") or 1)
            try:  # asked on the owner's control socket, before SGLang's locks
                rendezvous.ask(self.base_url, self.owner, self.timeout)
            except EngineError:  # another adapter holds it: what this one verified is void
                self.displaced = True
                raise
            starts = [{"op": "start", "socket": str(self.socket(r))} for r in range(self.tp)]
            self.boots = tuple(
                self._result(answer).get("boot") for answer in self.commands(starts, flush=False)
            )
            self._started = True
            rendezvous.note(self.base_url, self.socket(0))

    def _result(self, answer: dict[str, Any]) -> dict[str, Any]:
        """:func:`.wire.result`, noting a refusal because another adapter drives SGLang."""
        try:
            return result(answer)
        except EngineError as e:
            if e.context.get("other_adapter"):
                self.displaced = True
            raise

    def restart(self) -> None:
        """Start the control threads again at the next call (a control call failed: a
        restarted SGLang has none; starting them again where they run is a no-op)."""
        self._started = False
        self._session_open = False

    def control(self, op: str, *, rank: int = 0, **args: Any) -> dict[str, Any]:
        """A read-only operation on rank ``rank``'s control thread (generation goes on)."""
        self.start()
        req = {"op": op, **args, "owner": self.owner}
        return self._result(request(self.socket(rank), req, self.timeout))

    def controls(self, op: str, **args: Any) -> list[dict[str, Any]]:
        """:meth:`control` on every rank at once (each rank's control thread works on its own
        block: a digest, a staging, a copy into a shared buffer), answers in rank order; after
        every rank answered, the first failure in rank order is raised. One rank after another
        took the sum of the ranks' times instead of the longest."""
        self.start()
        if self.tp == 1:
            return [self.control(op, rank=0, **args)]
        with ThreadPoolExecutor(self.tp, thread_name_prefix="rollpatch-sglang-rank") as pool:
            futures = [pool.submit(self.control, op, rank=r, **args) for r in range(self.tp)]
            wait(futures)
        return [f.result() for f in futures]

    def command(self, cmd: dict[str, Any], *, flush: bool) -> dict[str, Any]:
        """``cmd`` on every rank through SGLang's weight-update route (between forward
        passes); rank 0's answer (any rank's error is raised)."""
        answers = [self._result(a) for a in self.commands([cmd] * self.tp, flush=flush)]
        return answers[0]

    def commands(self, cmds: list[dict[str, Any]], *, flush: bool) -> list[dict[str, Any]]:
        """One command per rank (rank ``r`` runs ``cmds[r]``) in one weight-update call;
        every rank's raw answer (``ok`` or ``error``: not raised here)."""
        with self.scratch.files("reply", len(cmds)) as replies:
            return self._commands(cmds, replies, flush=flush)

    def _commands(
        self, cmds: list[dict[str, Any]], replies: list[Path], *, flush: bool
    ) -> list[dict[str, Any]]:
        body = {
            "serialized_named_tensors": [
                command_payload({**cmd, "reply": str(path), "owner": self.owner})
                for cmd, path in zip(cmds, replies)
            ],
            "load_format": LOADER,
            "flush_cache": flush,
        }
        for _ in range(2):
            self._open_session()
            reply = self.http("POST", "/update_weights_from_tensor", body, check=False)
            if reply.get("success") or "begin_weight_update" not in str(reply.get("message")):
                break
            self._session_open = False  # closed by someone else, the command unrun: reopen
        answers = []
        for cmd, path in zip(cmds, replies):
            try:
                raw = path.read_bytes()
            except OSError:
                raise EngineError(
                    "SGLang did not run rollpatch's command",
                    engine="sglang",
                    op=cmd["op"],
                    detail=str(reply.get("message"))[:500],
                    hint=f"launch SGLang with --custom-weight-loader {LOADER}",
                ) from None
            try:
                answer = json.loads(raw)
            except json.JSONDecodeError:
                answer = None
            if not isinstance(answer, dict):
                raise EngineError(
                    "rollpatch's command answer is not JSON", engine="sglang", op=cmd["op"]
                )
            answers.append(answer)
        if not reply.get("success"):  # our command ran; SGLang's own step after it failed
            raise EngineError(
                "SGLang's weight-update route failed after the command",
                engine="sglang",
                detail=str(reply.get("message"))[:500],
            )
        return answers

    def _open_session(self) -> None:
        """SGLang's weight-update session, opened once and left open: SGLang 0.5.23 runs
        ``/update_weights_from_tensor`` only inside one, and for the unpacked CPU weights
        rollpatch accepts (docs/sglang.md) its ``/begin_weight_update`` and
        ``/end_weight_update`` are no-ops, so each commit's pause spares their two round
        trips. (They cannot move out of the pause: while SGLang generates, both take its
        model-update writer lock, i.e. wait for every request in flight.) :meth:`close`
        ends it."""
        if not self._session_open:
            self._session("/begin_weight_update")
            self._session_open = True

    def _session(self, route: str) -> None:
        """SGLang's weight-update session bracket (no-ops for unpacked CPU weights)."""
        reply = self.http("POST", route, {}, check=False)
        if not reply.get("success") and route == "/begin_weight_update":
            self.http("POST", "/end_weight_update", {}, check=False)  # a session left open
            reply = self.http("POST", route, {}, check=False)
        if not reply.get("success"):
            raise EngineError(
                f"SGLang refused {route}", engine="sglang", detail=str(reply.get("message"))[:500]
            )

    def pause(self) -> None:
        """Stop SGLang generating (``retract``; nested calls count)."""
        super().pause()

    def _freeze(self) -> None:
        self._frozen_at = time.perf_counter()
        self.http("POST", "/pause_generation", {"mode": "retract"})

    def _thaw(self) -> None:
        self.http("POST", "/continue_generation", {})
        self.held_s = time.perf_counter() - self._frozen_at

    def close(self) -> None:
        """End SGLang's weight-update session and forget the scratch directories (the server
        is not ours to stop)."""
        if self._session_open:
            self._session_open = False
            with contextlib.suppress(EngineError):
                self._session("/end_weight_update")
        if self.arena.path is not None:  # the ranks let go of its pages
            with contextlib.suppress(EngineError, OSError):
                self.controls("unmap_arena")
            self.arena.close()
        if self._started:  # the next adapter may start at once (not after the loader's lease)
            for r in range(self.tp):
                with contextlib.suppress(EngineError, OSError):
                    self.control("disown", rank=r)
            rendezvous.forget(self.base_url, self.socket(0))
            self._started = False
        self.scratch.close()
        if self._shm is not None and self._shm is not self.scratch:
            self._shm.close()
        self._shm = None
