"""The SGLang engine adapter: stages patches while SGLang serves, scatters them under its pause.

Runs in the sidecar's process and imports neither torch nor SGLang (stdlib HTTP and a UNIX
socket). A commit (docs/sglang.md):

1. **stage, while SGLang generates** — the patch goes to a file in a private directory; the
   control thread inside SGLang (:mod:`.loader`) decodes it against the live words, validates
   it and proves that it turns them into the target digests (:mod:`.staged`);
2. **under the pause** — ``POST /pause_generation`` (``retract``: running requests go back to
   the queue and recompute their cache after the commit), the ``commit`` command through
   SGLang's weight-update route (scatter + read-back, O(changed)), SGLang flushes its prefix
   cache, the adapter checks the result, then names the version (``/update_weight_version``)
   — only after verification — and ``POST /continue_generation``.

With ``writes="double_buffer"`` (:data:`~rollpatch.engines.staged.WriteMode`) step 1 also
builds each touched parameter's second buffer inside SGLang (written, checked, read back), and
the commit under the pause only exchanges storages (O(1) per parameter); the replaced storage
is freed after the pause, a tensor at a time.

On any failure the adapter asks the engine for its root: the previous version's → it stays
there (the error keeps its class for the follower); otherwise ``version`` becomes None and
SGLang's ``weight_version`` reads ``rollpatch:not-ready``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import EngineError, RollpatchError, TargetMismatchError
from ...io.safetensors import save_view
from ...patch import Patch, inspect
from ...view import View, WordSource
from ..base import EngineAdapter, require_adoptable
from ..catchup import decodes_in_place
from ..fit import ListedTensors
from ..restarts import RESTARTED, BootWatch
from ..staged import WriteMode
from ..vllm.transfer import write_decoded
from . import tp as tp_ops
from . import tpencoded
from .channel import SglangChannel
from .launch import LOADER  # what --custom-weight-loader must name; every command's load_format
from .single import stage_one
from .wire import step_files
from .words import RemoteWords

if TYPE_CHECKING:
    from ..staged import AuditReport, EncodedStep, StagedUpdate

__all__ = ["LOADER", "NOT_READY", "SglangEngine"]

#: SGLang's ``weight_version`` while the engine holds bits no version vouches for.
NOT_READY = "rollpatch:not-ready"


class SglangEngine(ListedTensors, EngineAdapter):
    """:class:`EngineAdapter` over an SGLang server launched with rollpatch's loader.

    ``url``: the server (``http://127.0.0.1:30000``, same host: files and a UNIX socket are
    shared). ``shared_dir``: a directory SGLang can read (default: a fresh private one).
    ``timeout``: seconds per call. ``writes``: :data:`~rollpatch.engines.staged.WriteMode`
    (``double_buffer``: + the touched parameters in SGLang's memory from staging to commit).

    Pausing is SGLang's ``retract`` mode: running requests go back to the queue, so SGLang
    can flush its prefix cache (whose keys do not include the weights) and recompute their
    cache with the new weights after the commit. ``in_place`` would keep their cache, but
    SGLang then refuses to flush, leaving old-weight prefixes to later requests; ``abort``
    would drop them.
    """

    name = "sglang"
    remote = True

    def __init__(
        self,
        url: str,
        *,
        shared_dir: str | Path | None = None,
        timeout: float = 600.0,
        writes: WriteMode = "in_place",
        token: str | None = None,
    ) -> None:
        if writes not in ("in_place", "double_buffer"):
            raise ValueError(f"writes must be 'in_place' or 'double_buffer', not {writes!r}")
        self.writes: WriteMode = writes
        self._lock = threading.RLock()
        self.engine_token = token  # SGLang's --api-key
        self.channel = SglangChannel(
            url, shared_dir=shared_dir, timeout=timeout, lock=self._lock, token=token
        )
        self._version: int | None = None
        self._digest: str | None = None
        self._boots = BootWatch("SGLang")  # the loaders' identities the version was set under
        self.last_timings: dict[str, float] = {}
        #: The last staging's phases inside SGLang (ms): ``decode`` (or ``read``), ``prove``,
        #: ``layout``, ``buffers`` and ``inside`` (the whole control call there).
        self.last_stage_ms: dict[str, float] = {}

    # -- state -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of SGLang's OpenAI-compatible server (proxied by the sidecar)."""
        return self.channel.base_url

    @property
    def version(self) -> int | None:
        # another adapter took SGLang over: its loads replaced what this one verified
        return None if self.channel.displaced else self._version

    @property
    def digest(self) -> str | None:
        return self._digest

    def info(self) -> dict[str, Any]:
        """``rank``, ``tp``, ``pid`` of SGLang's scheduler, ``tensors`` (name → [kind, shape])."""
        return self._control("info")

    @property
    def tp(self) -> int:
        """SGLang's tensor-parallel size (every rank runs rollpatch's control thread)."""
        self.channel.start()
        return self.channel.tp

    def held(self, *, fresh: bool = False) -> tuple[dict[str, str], str]:
        """Per-tensor digests and root of the live words (``fresh``: re-hash everything)."""
        if self.tp > 1:
            return tp_ops.held(self.channel, self.tensors(), fresh=fresh)
        r = self._control("digest", fresh=fresh)
        return r["digests"], r["root"]

    def weight_version(self) -> str | None:
        """SGLang's own ``weight_version`` tag (``GET /model_info``)."""
        return self.channel.http("GET", "/model_info").get("weight_version")

    def boot_digest(self) -> str:
        """The root over every rank's words, hashed now (the follower's adoption)."""
        with self._lock:
            return self.held(fresh=True)[1]

    def adopt(self, version: int, digest: str) -> None:
        """Take over a server that booted from a checkpoint: verified against ``digest``."""
        with self._lock:
            _, root = self.held(fresh=True)
            require_adoptable(self.name, digest, root)
            self._set(version, root)
            self.channel.tag(str(version))

    # -- commits -----------------------------------------------------------------------------

    def load(self, view: View, version: int) -> None:
        """Write a keyframe in place (validated whole first), verified by a full re-hash."""
        with self._lock, self.channel.scratch.files("keyframe") as (path,):
            save_view(view, path)
            target = view.digest()
            self._write(
                {"op": "load", "path": str(path)},
                version,
                lambda res: (res["root"] if self.tp == 1 else self.held()[1]) == target,
                target,
            )

    def words(self) -> WordSource:
        return RemoteWords(self)

    def apply(self, patch: Patch, version: int) -> None:
        """Commit a decoded patch: staged while SGLang serves, scattered under the pause."""
        with self._lock:
            self.commit_staged(self._must(self.stage(patch, version)), version)

    def stage(self, patch: Patch, version: int) -> StagedUpdate | None:
        """Prove a decoded patch inside SGLang (while it serves); :meth:`commit_staged`
        writes it. The decoded patch crosses processes as a file (12 bytes per BF16 change)."""
        targets = {n: tp.target_digest for n, tp in patch.tensors.items()}
        with self._lock, self.channel.scratch.files("patch") as (path,):
            self._require_loaded()
            write_decoded(patch, path)
            if self.tp > 1:  # every rank stages its part; their sum is proven here
                return self._on_ranks(tp_ops.stage_update, patch, path)
            call = {"paths": [str(path)], "base": patch.base, "target": patch.target}
            return self._stage("stage_decoded", call, targets, patch.base, patch.target)

    def stage_encoded(self, steps: Sequence[EncodedStep], version: int) -> StagedUpdate | None:
        """Decode a chain of published steps (one or many: every shard's object per step)
        inside SGLang against its own words and prove it (each touched tensor step after step
        in a private copy, :func:`rollpatch.engines.catchup.decode_in_place`; at TP > 1 by the
        rank that owns it, :mod:`.tpencoded`): nothing of the model enters this process. None for
        a chain (TP > 1: any plan) with a step in another codec (the follower's :meth:`words`)."""
        if not steps or any(not s.blobs for s in steps):
            return None
        if self.tp > 1:
            with self._lock:
                self._require_loaded()
                return self._on_ranks(
                    tpencoded.stage_encoded, steps, fresh=self.channel.shm, arena=self.channel.arena
                )
        targets: dict[str, str | None] = {}
        for blob in (b for s in steps for b in s.blobs):
            entries = inspect(blob).tensors
            if len(steps) > 1 and not all(decodes_in_place(e) for e in entries):
                return None
            targets.update({e["name"]: e["target"] for e in entries})
        n = sum(len(s.blobs) for s in steps)
        with self._lock, self.channel.scratch.files("blob", n) as paths:
            self._require_loaded()
            spec = step_files(steps, iter(paths))
            base, target = steps[0].base, steps[-1].target
            return self._stage("stage_encoded", {"steps": spec}, targets, base, target)

    def commit_staged(self, staged: StagedUpdate, version: int) -> None:
        """Under the pause: scatter the staged writes inside SGLang, read them back."""
        token = staged.payload.get("sglang_token")
        tokens = staged.payload.get("sglang_tokens")
        if not isinstance(token, str) and not isinstance(tokens, list):
            raise EngineError("this update was not staged by the SGLang adapter", engine=self.name)
        with self._lock:
            self._require_loaded()
            if isinstance(tokens, list):  # TP > 1: every rank's part, proven by tp.stage
                res = self._write(
                    {"op": "commit", "tokens": tokens},
                    version,
                    lambda res: self.held()[1] == staged.target,
                    staged.target,
                )
                self.last_timings["exchanged"] = float(res.get("exchanged", 0))
                tp_ops.release(self.channel)  # after the pause: every rank committed
                return
            res = self._write(
                {"op": "commit", "token": token},
                version,
                lambda res: res["target"] == staged.target and res["root"] == staged.target,
                staged.target,
            )
            # parameters whose storage was exchanged (double-buffered), 0 when scattered
            self.last_timings["exchanged"] = float(res.get("exchanged", 0))

    def apply_encoded(self, blobs: Sequence[bytes], base: str, target: str, version: int) -> None:
        """Commit one step's wire-format patch objects (``base`` → ``target`` roots)."""
        from ..staged import EncodedStep

        with self._lock:
            staged = self.stage_encoded([EncodedStep(tuple(blobs), base, target)], version)
            self.commit_staged(self._must(staged), version)

    def audit(self, budget_bytes: int) -> AuditReport | None:
        """Re-hash up to ``budget_bytes`` of live weights inside SGLang (round-robin) while
        it serves, against the verified digests of the version held; an SGLang restarted
        under the sidecar (new loader identities) is out of rotation until re-synced."""
        from ..staged import AuditReport

        with self._lock:
            if self._version is None:
                return None
            try:
                rs = [
                    self._control("audit", rank=r, budget=int(budget_bytes)) for r in range(self.tp)
                ]
            except EngineError:
                self.channel.restart()  # the next call starts the control threads again
                if self.channel.displaced:  # SGLang's tag is the other adapter's now
                    self._set(None, None)
                raise
            boots = tuple(r.get("boot") for r in rs)
            restarted = self._boots.restarted(boots, self.url, self._version)
            bad = tuple(sorted({n for r in rs for n in r["mismatched"]}))
            if restarted or bad:  # unknown words: out of rotation until re-synced
                self._set(None, None)
                with contextlib.suppress(RollpatchError):
                    self.channel.tag(NOT_READY)
        return AuditReport(
            sum(int(r["tensors"]) for r in rs),
            sum(int(r["nbytes"]) for r in rs),
            (RESTARTED, *bad) if restarted else bad,
            all(bool(r["wrapped"]) for r in rs),
        )

    def _stage(
        self,
        op: str,
        args: dict[str, Any],
        targets: Mapping[str, str | None],
        base: str,
        target: str,
    ) -> StagedUpdate:
        """TP 1: :func:`.single.stage_one`, timed."""
        t0 = time.perf_counter()
        staged, r = stage_one(
            self.channel, op, args, targets=targets, base=base, target=target, mode=self.writes
        )
        self._timed(t0, r)
        return staged

    def _on_ranks(self, stage: Any, what: Any, *args: Any, **kw: Any) -> StagedUpdate | None:
        """TP > 1: ``stage(channel, what, *args, root, tensors, mode, **kw)`` on every rank,
        timed (None: the ranks do not take ``what``)."""
        t0 = time.perf_counter()
        got = stage(self.channel, what, *args, self._digest, self.tensors(), self.writes, **kw)
        if got is None:
            return None
        self._timed(t0, got[1])
        return got[0]

    def _timed(self, t0: float, r: Mapping[str, Any]) -> None:
        """A staging's timings: here (``stage_s``) and inside SGLang (:attr:`last_stage_ms`)."""
        self.last_timings["stage_s"] = time.perf_counter() - t0
        self.last_stage_ms = {k: float(v) for k, v in (r.get("phases") or {}).items()}
        self.last_stage_ms["inside"] = float(r.get("ms", 0.0))

    @staticmethod
    def _must(staged: StagedUpdate | None) -> StagedUpdate:
        if staged is None:
            raise EngineError(
                "the SGLang adapter could not stage this update",
                engine="sglang",
                hint="one step at a time",
            )
        return staged

    def _write(
        self, cmd: dict[str, Any], version: int, verified: Any, target: str
    ) -> dict[str, Any]:
        """Run a writing command under the pause; the version moves only if ``verified``."""
        self.channel.start()
        before = (self._version, self._digest)
        with self.channel.paused():
            t0 = time.perf_counter()
            try:
                if "tokens" in cmd:
                    res = tp_ops.commit(self.channel, list(cmd["tokens"]))
                else:
                    res = self.channel.command(cmd, flush=True)
                self.last_timings["command_s"] = float(res.get("ms", 0.0)) / 1e3
                if not verified(res):
                    raise TargetMismatchError(
                        "the engine reports another root than the target",
                        engine=self.name,
                        version=version,
                        expected=target[:16],
                        actual=str(res["root"])[:16],
                    )
                self._set(version, target)
                self.channel.tag(str(version))  # named only now: after the read-back checked out
            except BaseException:
                self._reconcile(before)
                raise
            finally:
                self.last_timings["pause_s"] = time.perf_counter() - t0
        return res

    def _reconcile(self, before: tuple[int | None, str | None]) -> None:
        """After a failed commit: the previous version if the engine still holds its bits,
        else not ready (never a version over unknown bits)."""
        with contextlib.suppress(RollpatchError):
            if before[1] is not None and self.held()[1] == before[1]:
                self._set(*before)
                self.channel.tag(str(before[0]))
                return
        self._set(None, None)
        with contextlib.suppress(RollpatchError):
            self.channel.tag(NOT_READY)

    # -- plumbing ----------------------------------------------------------------------------

    def _set(self, version: int | None, digest: str | None) -> None:
        """The held version, with the loaders' identities it was set under."""
        self._version, self._digest = version, digest
        self._boots.set(self.channel.boots or None, version)
        if version is not None:  # verified through this adapter's own calls
            self.channel.displaced = False

    def _require_loaded(self) -> None:
        if self._version is None:
            raise EngineError(
                "the engine holds no verified version",
                engine=self.name,
                hint="load a keyframe (or adopt a booted checkpoint) first",
            )

    def _control(self, op: str, **args: Any) -> dict[str, Any]:
        return self.channel.control(op, **args)

    def pause(self) -> None:
        """Stop SGLang generating (``retract``, see the class docstring; nested calls count)."""
        self.channel.pause()

    def resume(self) -> None:
        self.channel.resume()

    def claim(self) -> None:
        with self._lock:
            self.channel.start()  # the loader's claim (asked first on the owner's socket)

    def close(self) -> None:
        """Forget the scratch directory (the server is not ours to stop)."""
        self.channel.close()
