"""The vLLM engine adapter: commits into a stock vLLM server over HTTP, verified.

Runs in the sidecar's process and imports neither torch nor vLLM: it writes a file into a
directory it shares with the server (same host), asks the workers to apply it in place
(:mod:`.worker`), checks the per-tensor digests they return against the patch's targets,
then tags the server's ``weight_version`` and flushes the prefix cache. See docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ...errors import BaseMismatchError, EngineError, RollpatchError, TargetMismatchError
from ...io.safetensors import save_view
from ...patch import Patch, inspect
from ...validate import check_choice
from ...view import View, WordSource
from ..base import EngineAdapter, require_adoptable
from ..fit import ListedTensors
from ..restarts import RESTARTED, BootWatch
from ..staged import AuditReport, EncodedStep, StagedUpdate
from .core import ATOMIC, KvOnCommit
from .kvmode import KvMode
from .rpc import NOT_READY, RemoteWords, WorkerCalls
from .transfer import write_decoded
from .writes import WriteMode

__all__ = ["TRANSPORTS", "RemoteWords", "VllmEngine"]

#: ``weight-transfer``: the official routes (needs ``--weight-transfer-config
#: '{"backend": "rollpatch"}'``); ``rpc``: ``/collective_rpc`` only; ``auto``: the first when
#: the server was started with the backend, else the second.
TRANSPORTS = ("auto", "weight-transfer", "rpc")
#: CPU packed weights of the touched modules: built while staging and swapped in under the
#: pause (``stage``), or re-packed inside the pause (``pause``: less memory, longer pause).
Prepack = Literal["stage", "pause"]
#: Where the workers stage: in a thread while vLLM serves (the default; at TP > 1 where the
#: staging gathers can have a group of their own), or inline on vLLM's engine loop, which
#: holds generation for the whole staging but gives it every core (on a host whose cores
#: the forward passes keep busy, the shorter total cost: docs/vllm.md, *Tensor parallelism*).
Staging = Literal["thread", "inline"]


class VllmEngine(ListedTensors, WorkerCalls, EngineAdapter):
    """:class:`EngineAdapter` over a vLLM server started with rollpatch's worker extension.

    ``url``: the server (``http://127.0.0.1:8000``). ``shared_dir``: a directory the server
    can read (default: a private temporary directory, so the server must run on this host).
    ``transport``: one of :data:`TRANSPORTS`. ``timeout``: seconds per HTTP call.
    ``prepack``: see :data:`Prepack`. ``writes``: see :data:`~.writes.WriteMode`.
    ``kv_on_commit``: what a staged commit does to the KV of requests in flight
    (:data:`~.core.KvOnCommit`: ``recompute`` them with the new weights, or ``keep`` them and
    go on with the new weights over it; needs the engine-core hook). Keyframe loads and
    unstaged patches always recompute. ``staging``: see :data:`Staging`.
    """

    name = "vllm"
    remote = True

    def __init__(
        self,
        url: str,
        *,
        shared_dir: str | Path | None = None,
        transport: str = "auto",
        timeout: float = 600.0,
        prepack: Prepack = "stage",
        writes: WriteMode = "in_place",
        kv_on_commit: KvOnCommit = "recompute",
        staging: Staging = "thread",
        token: str | None = None,
    ) -> None:
        check_choice("VllmEngine", "transport", transport, TRANSPORTS)
        check_choice("VllmEngine", "prepack", prepack, ("stage", "pause"))
        check_choice("VllmEngine", "writes", writes, ("in_place", "double_buffer"))
        check_choice("VllmEngine", "staging", staging, ("thread", "inline"))
        self.prepack, self.writes, self.kv = prepack, writes, KvMode(kv_on_commit)
        self.staging = staging
        super().__init__(url, shared_dir, timeout, token)
        self.engine_token = token
        self._transport = transport
        self._version: int | None = None
        self._digest: str | None = None
        self._atomic: bool | None = None
        self._boot = BootWatch("vLLM")  # the workers' identity the version was set under

    # -- state -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible server (proxied by the sidecar)."""
        return self.http.base_url

    @property
    def version(self) -> int | None:
        # another adapter took the engine over: its loads replaced what this one verified
        return None if self.displaced else self._version

    @property
    def digest(self) -> str | None:
        return self._digest

    @property
    def transport(self) -> str:
        """The transport in use (``auto`` resolved on first use)."""
        if self._transport == "auto":
            official = self.info().get("weight_transfer") == "rollpatch"
            self._transport = "weight-transfer" if official else "rpc"
        return self._transport

    def info(self) -> dict[str, Any]:
        """Rank 0's report: ``rank``, ``tp``, ``aliases`` (zero-copy reads), ``tensors``
        (name → [kind, shape]), ``weight_transfer`` (backend or None), ``packed_modules``
        (CPU modules set up by the packing dispatcher), ``owning_modules`` (those whose kernel
        holds its own copy of the words: rebuilt after writes), ``kernel_only_modules`` (those
        served only through that copy: their plain words are written after a commit's
        pause)."""
        return self._call("info")

    def held(self, *, fresh: bool = False) -> tuple[dict[str, str], str]:
        """Per-tensor digests and root the workers compute now (``fresh``: re-hash all)."""
        r = self._call("digest", "1" if fresh else "0")
        return r["digests"], r["root"]

    def boot_digest(self) -> str:
        """The workers' root over all their words, hashed now (the follower's adoption)."""
        return self.held(fresh=True)[1]

    def adopt(self, version: int, digest: str) -> None:
        """Take over a server that booted from a checkpoint: verified against ``digest``, and
        refused where what the kernels serve may differ from those words: an audit found
        such words (``tainted``), or the CPU-packed experts differ from their plain words
        (re-packed and compared: O(experts), once). A keyframe load re-packs every layer."""
        r = self._call("digest", "1")
        require_adoptable(self.name, digest, r["root"])
        bad = [str(r["tainted"])] if r.get("tainted") else self._call("packed", "1")["mismatched"]
        if bad:
            raise EngineError(
                "the engine serves other words than it holds (an audit found them, or its "
                "CPU-packed experts differ from their plain words): not adoptable",
                engine=self.name,
                tensors=", ".join(bad[:3]),
                hint="boot it from a keyframe (its load re-packs every layer)",
            )
        self._set(version, r["root"])

    # -- commits -----------------------------------------------------------------------------

    def load(self, view: View, version: int) -> None:
        with self.scratch.files("keyframe") as (path,):
            save_view(view, path)  # before the pause: it holds only the workers' writes
            target = view.digest()
            with self.paused():
                self._commit("load", path, version, lambda res: res["root"] == target)

    def words(self) -> WordSource:
        return RemoteWords(self)

    def apply(self, patch: Patch, version: int) -> None:
        """Commit a decoded patch (shipped as :mod:`.transfer`'s file), verified."""
        self._require_loaded()
        targets = {n: tp.target_digest for n, tp in patch.tensors.items()}
        with self.scratch.files("patch") as (path,):
            write_decoded(patch, path)
            with self.paused():
                self._commit(
                    "apply",
                    path,
                    version,
                    lambda res: self._matches(res, targets, patch.target),
                    patch,
                )

    def stage_encoded(self, steps: Sequence[EncodedStep], version: int) -> StagedUpdate:
        """Stage a chain of published steps inside the workers while vLLM serves: the blobs go
        through the shared directory; the workers decode, compose and prove them against
        their own words in a background thread (docs/vllm.md). Nothing is written."""
        self._require_loaded()
        if not steps or steps[0].base != self._digest:
            raise BaseMismatchError(
                "the chain does not start at the held version", engine=self.name, version=version
            )
        token = secrets.token_hex(8)
        options = {"prepack": self.prepack, "writes": self.writes, "staging": self.staging}
        res = self._stage_steps(token, steps, options)
        if res["base"] != steps[0].base or res["target"] != steps[-1].target:
            self._call("discard", token)
            raise TargetMismatchError("the workers staged another transition", engine=self.name)
        return StagedUpdate(
            res["base"],
            res["target"],
            {},
            dict(res["digests"]),
            {
                "token": token,
                "changed": int(res["changed"]),
                "nbytes": int(res["nbytes"]),
                "stage_ms": float(res["stage_ms"]),
                "stage_phases": dict(res.get("stage_phases") or {}),
                "stage_memory": dict(res.get("stage_memory") or {}),
            },
        )

    def commit_staged(self, staged: StagedUpdate, version: int) -> None:
        """Write a staged update. With the engine-core hook (:mod:`.core`): one engine-core
        call that writes, tags and resets the prefix cache between two forward passes (no
        pause around it). Else under the caller's pause (the commit gate's; nested pauses
        cost nothing): the workers scatter, repack the touched modules, read back."""
        token = staged.payload.get("token")
        if not isinstance(token, str):
            raise EngineError("not an update staged by this engine", engine=self.name)
        if self.pauses_itself:
            self._commit_atomic(token, staged, version)
            return
        self.kv.require_hook(self.name)
        with self.paused():
            self._commit(
                "commit",
                token,
                version,
                lambda res: self._matches(res, staged.digests, staged.target),
            )

    @property
    def kv_across_commit(self) -> str:
        """``kv_on_commit``, as the last staged commit applied it (:class:`.kvmode.KvMode`)."""
        return self.kv.current

    @property
    def pauses_itself(self) -> bool:
        """True when the server runs the engine-core hook (:mod:`.core`): a staged commit
        then holds generation by itself, for one engine-core call, and every other weight
        change pauses around itself, so the commit gate does not pause this engine."""
        if self._atomic is None:
            self._atomic = bool(self.info().get("atomic_commit"))
        return self._atomic

    def _commit_atomic(self, token: str, staged: StagedUpdate, version: int) -> None:
        with self._lock:
            before = (self._version, self._digest)
            self.last_timings = {}
            t0 = time.perf_counter()
            try:
                res = self._gather(
                    self._rpc(ATOMIC, token, str(version), staged.target, self.kv.requested)
                )
                self.last_timings["rpc_ms"] = (time.perf_counter() - t0) * 1e3
                if not self._matches(res, staged.digests, staged.target):
                    raise TargetMismatchError(
                        "the engine reports other digests than the target",
                        engine=self.name,
                        version=version,
                    )
                if not res.get("reset"):
                    raise EngineError("vLLM did not reset its prefix cache", engine=self.name)
                self.kv.note(res)
                self._set(version, res["root"])
            except BaseException:
                self._set(None, None)
                self._reconcile(before)
                if not self.displaced:  # else the engine's tag is the other adapter's
                    with contextlib.suppress(RollpatchError):
                        tag = str(self._version) if self._version is not None else None
                        self.http.post("/update_weight_version", {"new_version": tag or NOT_READY})
                raise

    def audit(self, budget_bytes: int) -> AuditReport:
        """Re-hash up to ``budget_bytes`` of live weights in the workers (on vLLM's engine
        loop: a stall of about budget / memory bandwidth); a mismatch makes the adapter not
        ready (``version`` None) until a keyframe is loaded."""
        with self._lock:
            res = self._call("audit", str(int(budget_bytes)))  # displaced: refused, version void
            restarted = self._boot.restarted(res.get("boot"), self.url, self._version)
            if res["mismatched"] or res.get("tainted") or restarted:
                self._set(None, None)
                with contextlib.suppress(RollpatchError):
                    self.http.post("/update_weight_version", {"new_version": NOT_READY})
        bad = tuple(res["mismatched"]) or ((str(res["tainted"]),) if res.get("tainted") else ())
        return AuditReport(
            int(res["tensors"]),
            int(res["bytes"]),
            (RESTARTED, *bad) if restarted else bad,
            bool(res["wrapped"]),
        )

    def apply_encoded(self, blob: bytes | memoryview, version: int) -> None:
        """Commit a wire-format patch, decoded inside the workers against their own words."""
        self._require_loaded()
        header = inspect(blob)
        targets = {e["name"]: e["target"] for e in header.tensors}
        with self.scratch.files("blob") as (path,):
            path.write_bytes(blob)
            with self.paused():
                self._commit(
                    "apply_encoded",
                    path,
                    version,
                    lambda res: self._matches(res, targets, header.target),
                )

    @staticmethod
    def _matches(res: Mapping[str, Any], targets: Mapping[str, str | None], root: str) -> bool:
        return res["root"] == root and all(res["digests"].get(n) == d for n, d in targets.items())

    def _commit(
        self, op: str, path: Path | str, version: int, verified: Any, patch: Patch | None = None
    ) -> dict[str, Any]:
        """Run ``op`` on the workers; the version moves only if ``verified(result)``.

        The held version stays reported while the bits change: the engine is paused (or
        drained), so nothing it produces meanwhile comes from other weights; a failure
        reports the previous version if the workers still hold it, else none."""
        with self._lock:
            # a staged commit is one worker call: collective_rpc (the official routes would add
            # three HTTP round trips inside the pause); the version is tagged either way
            official = self.transport == "weight-transfer" and op != "commit"
            before = (self._version, self._digest)
            started = done = False
            try:
                if official:
                    self.http.post("/start_weight_update")
                    started = True
                t0 = time.perf_counter()
                res = self._run(op, path, official)
                self.last_timings["rpc_ms"] = (time.perf_counter() - t0) * 1e3
                if not verified(res):
                    self._rollback(patch, before)
                    raise TargetMismatchError(
                        "the engine reports other digests than the target",
                        engine=self.name,
                        op=op,
                        version=version,
                    )
                self._set(version, res["root"])
                done = True
            except BaseException:
                self._set(None, None)
                if op in ("commit", "apply_encoded", "apply"):
                    self._undo(str(path))
                self._reconcile(before)
                raise
            finally:
                tag = str(version) if done else None
                if started:  # names the version only once the workers' digests checked out
                    self.http.post("/finish_weight_update", {"weight_version": tag})
                untagged = (tag is not None and not started) or self._version is None
                if untagged and not self.displaced:
                    self._timed(
                        "tag_ms", "/update_weight_version", {"new_version": tag or NOT_READY}
                    )
            self._timed("reset_ms", "/reset_prefix_cache")
            return res

    def _reconcile(self, before: tuple[int | None, str | None]) -> None:
        """After a failed commit: the previous version if the engine still holds its bits,
        else not ready (never a version over unknown bits)."""
        with contextlib.suppress(RollpatchError):
            if before[1] is not None and self.held()[1] == before[1]:
                self._set(*before)

    def _rollback(self, patch: Patch | None, before: tuple[int | None, str | None]) -> None:
        """The workers verified but the adapter disagrees: undo with the inverse patch."""
        if patch is None or before[1] is None:
            return
        with self.scratch.files("inverse") as (path,):
            try:
                write_decoded(patch.inverse(), path)
                self._call("apply", str(path))
            except RollpatchError:
                pass  # _reconcile decides: previous version or not ready

    # -- plumbing ----------------------------------------------------------------------------

    def _set(self, version: int | None, digest: str | None) -> None:
        """The held version; the workers' identity with it (the last answer's: the call that
        made these words the version's, or None when it did not say)."""
        self._version, self._digest = version, digest
        self._boot.set(self.last_boot, version)
        if version is not None:  # verified through this adapter's own calls
            self.displaced = False

    def _require_loaded(self) -> None:
        if self.version is None:
            raise EngineError(
                "the engine holds no verified version",
                engine=self.name,
                hint="load a keyframe (or adopt a booted checkpoint) first",
            )
