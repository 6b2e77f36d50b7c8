"""The reference engine adapter: the follower commits into a :class:`ReferenceRuntime`.

In process: the adapter writes the runtime's in-place view (the model's own parameter memory)
under the runtime's forward lock, and serves generation over HTTP with
:func:`~rollpatch.engines.reference.server.serve` so the sidecar can proxy to :attr:`url`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, ConfigError, EngineError, TargetMismatchError
from ...patch import Patch
from ...patch.ops import gather, scatter
from ...view import Tensor, View, WordSource, sum128, sum128_digest
from ..base import EngineAdapter, require_adoptable
from ..catchup import decode_in_place
from ..fit import ModelTensors, tensors_of_view
from ..rewind import REWIND_MAX_BYTES, RewindLog
from ..staged import (
    AuditCursor,
    AuditReport,
    EncodedStep,
    StagedUpdate,
    WriteMode,
    stage_patch,
)
from ..writing import ParamWrites, copy_with_writes, numpy_access, release_later, write_params
from .runtime import ReferenceRuntime
from .server import ServerHandle, serve

__all__ = ["ReferenceEngine"]


class ReferenceEngine(EngineAdapter):
    """:class:`EngineAdapter` over a :class:`ReferenceRuntime` in this process.

    A commit is staged while the engine serves (:meth:`stage`: base checks, old elements,
    target digests proven in O(changed); :mod:`rollpatch.engines.staged`), then written under
    the forward lock (:meth:`commit_staged`: one scatter per tensor, a read-back of the
    written positions, the proven digests recorded) — between forward passes, or while
    paused. The runtime's ``version`` moves only on success; on failure the written
    elements are put back. There are no prefix or KV caches shared across requests, so a
    commit has nothing to flush; a request in flight during a paused commit keeps its own KV
    cache and reports ``version_start != version_end``. :meth:`audit` re-hashes live weights
    a slice at a time and takes the engine out of rotation (``version`` None) on a mismatch.
    """

    name = "reference"

    def __init__(
        self,
        runtime: ReferenceRuntime,
        *,
        serve_http: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        writes: WriteMode = "in_place",
        rewind_max_bytes: int = REWIND_MAX_BYTES,
    ) -> None:
        if writes not in ("in_place", "double_buffer"):
            raise ConfigError(
                f"unknown writes {writes!r}", field="writes", hint="in_place or double_buffer"
            )
        if (
            isinstance(rewind_max_bytes, bool)
            or not isinstance(rewind_max_bytes, int)
            or (rewind_max_bytes < 0)
        ):
            raise ConfigError(
                "rewind_max_bytes must be an int >= 0 (0: keep no rewind records)",
                field="rewind_max_bytes",
                value=rewind_max_bytes,
            )
        self.runtime, self.writes = runtime, writes
        self._server: ServerHandle | None = serve(runtime, host, port) if serve_http else None
        self._cursor = AuditCursor()
        #: Records of this engine's commits, to catch up from an older anchor by one folded
        #: patch (:mod:`rollpatch.engines.rewind`); ``rewind_max_bytes`` 0 keeps none.
        self.rewind = RewindLog(max_bytes=rewind_max_bytes)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "bfloat16",
        threads: int | None = None,
        serve_http: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        writes: WriteMode = "in_place",
        rewind_max_bytes: int = REWIND_MAX_BYTES,
    ) -> ReferenceEngine:
        """Load a Hugging Face causal LM directory and (by default) serve it."""
        runtime = ReferenceRuntime(model_dir, dtype=dtype, threads=threads)
        return cls(
            runtime,
            serve_http=serve_http,
            host=host,
            port=port,
            writes=writes,
            rewind_max_bytes=rewind_max_bytes,
        )

    @property
    def kv_across_commit(self) -> str:
        """``keep``: a generation held at the gate keeps its KV cache (docs/engines.md, *Pause
        semantics*)."""
        return "keep"

    @property
    def version(self) -> int | None:
        return self.runtime.version

    @property
    def digest(self) -> str | None:
        return self.runtime.digest()

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible server (``http://host:port``)."""
        if self._server is None:
            raise EngineError(
                "engine is not serving HTTP",
                engine=self.name,
                hint="construct with serve_http=True",
            )
        return self._server.url

    def load(self, view: View, version: int) -> None:
        self.rewind.clear()
        self.runtime.load_view(view, version)

    def boot_digest(self) -> str:
        """The root over every parameter, hashed now (cached digests dropped first)."""
        with self.runtime.commit() as view:
            view.invalidate()
            return view.digest()

    def adopt(self, version: int, digest: str) -> None:
        """Take the parameters the runtime loaded (its model directory) as ``version`` if
        they hash to ``digest`` now; nothing changes otherwise."""
        with self.runtime.commit() as view:
            view.invalidate()
            root = view.digest()
            require_adoptable(self.name, digest, root)
            self.rewind.clear()
            self.runtime.version = version

    def rewindable(self) -> dict[int, str]:
        return self.rewind.rewindable() if self.runtime.version is not None else {}

    def note_anchor(self, version: int) -> None:
        self.rewind.prune(version)

    def words(self) -> WordSource:
        return self.runtime.view

    def model_tensors(self) -> ModelTensors:
        return tensors_of_view(self.runtime.view)

    def apply(self, patch: Patch, version: int) -> None:
        """Stage and write under the forward lock (the contract's one-call commit)."""
        with self.runtime.commit():
            self.commit_staged(self.stage(patch, version), version)

    def stage(self, patch: Patch, version: int) -> StagedUpdate:
        """Prove ``patch`` against the parameters while generation runs (reads only touched
        positions and cached digests; only commits write the parameters)."""
        return self._buffered(self._prove(patch))

    def stage_encoded(self, steps: Sequence[EncodedStep], version: int) -> StagedUpdate | None:
        """Decode a chain of published steps (one or many) into one copy per touched tensor
        while generation runs (:mod:`rollpatch.engines.catchup`: the decoder's own rp.sum128
        changes prove the targets; a catch-up composes by one diff, not n decodes against
        overlays) and prove it. None when a step is not in the in-place codec (the follower
        then decodes it through :meth:`words`). The chain may start at a :meth:`rewindable`
        version: the copies are rebuilt to it from the records first (proven), and the
        update staged is still from the held words."""
        view = self.runtime.view
        held = view.digest()
        rewind = None
        if steps and steps[0].base != held:  # an older version the records rebuild
            rewind = self.rewind.rewind(steps[0].base, held)
        if not steps or (steps[0].base != held and rewind is None):
            raise BaseMismatchError(
                "the chain does not start at the held version", engine=self.name, version=version
            )
        spec = [{"base": s.base, "target": s.target} for s in steps]
        blobs = [list(s.blobs) for s in steps]
        try:
            out = decode_in_place(view, spec, blobs, view.sum_state, rewind=rewind, held=held)
        except BaseMismatchError:
            if rewind is not None:  # the records or the words they rebuilt are suspect
                self.rewind.clear()
            raise
        if out is None:
            return None
        patch, known = out
        return self._buffered(self._prove(patch, known))

    def _prove(
        self, patch: Patch, known: Mapping[str, tuple[int, int]] | None = None
    ) -> StagedUpdate:
        """``stage_patch`` against the held view, its tensors on the native threads."""
        view = self.runtime.view
        return stage_patch(
            patch,
            view.__getitem__,
            view.tensor_digests(),
            view.sum_state,
            known=known,
            parallel=True,
        )

    def _buffered(self, staged: StagedUpdate) -> StagedUpdate:
        """``double_buffer``: each touched tensor's new storage, built now (a copy of the
        live words with the writes in: old words checked, new ones read back)."""
        if self.writes == "double_buffer":
            view, buffers = self.runtime.view, {}
            for name, st in staged.tensors.items():
                t = view[name]
                if not t.kind.packed and t.data.flags.c_contiguous:  # one native pass
                    data = np.empty_like(t.data)
                    copy_with_writes(
                        t.data.reshape(-1), data.reshape(-1), st.positions, st.old, st.new, name
                    )
                    buffers[name] = data
                    continue
                buf = Tensor(t.kind, t.shape, t.data.copy())
                scatter(buf, st.positions, st.new, st.old)
                if not np.array_equal(gather(buf, st.positions), st.new):
                    raise TargetMismatchError("read-back of a staged buffer differs", tensor=name)
                buffers[name] = buf.data
            # made ready now (torch tensors, view tensors): the pause only assigns them
            staged.payload["buffers"] = self.runtime.storage(buffers)
        return staged

    def commit_staged(self, staged: StagedUpdate, version: int) -> None:
        """Write ``staged`` under the forward lock: scatter and read back (``double_buffer``:
        exchange the staged buffers for the parameters' storage), record the digests."""
        retired: dict[str, Any] = {}
        with self.runtime.commit(root=staged.target) as view:
            if self.runtime.held_digest != staged.base:
                self.rewind.clear()
                raise BaseMismatchError(
                    "the engine moved since the update was staged",
                    engine=self.name,
                    expected=staged.base[:16],
                )
            before = self.runtime.version
            states = {n: view.cached_sum_state(n) for n in staged.tensors}
            buffers = staged.payload.get("buffers")
            try:
                if isinstance(buffers, dict):
                    retired = self.runtime.exchange(buffers)  # O(1) per tensor; all or nothing
                    staged.payload.pop("buffers")
                else:
                    self._write(view, staged)
            except BaseException:
                self.rewind.clear()
                raise
            if before is not None:  # references to the staged arrays: no copies
                self.rewind.record(before, staged.base, staged.target, staged.tensors, states.get)
            else:
                self.rewind.clear()
            for name, st in staged.tensors.items():
                if st.target_state is not None:
                    view.update_sum_state(name, st.target_state)
                else:
                    view.invalidate(name)
            for name, d in staged.digests.items():
                if name not in staged.tensors or staged.tensors[name].target_state is not None:
                    view.set_digest(name, d)
            self.runtime.version = version
        if retired:  # the replaced storage is freed off the pause, a tensor at a time
            release_later(retired)

    def _write(self, view: View, staged: StagedUpdate) -> None:
        """Checked writes and their read-back, all or nothing: whole-element tensors with the
        vLLM worker's writer (old words checked as they are overwritten, slices read back
        in cache, tensors on every core); packed 4-bit tensors one checked scatter each."""
        ts = staged.tensors
        plain = [n for n in ts if not view[n].kind.packed]
        writes = {n: ParamWrites(ts[n].positions, ts[n].old, ts[n].new) for n in plain}
        write_params(numpy_access({n: view[n].data for n in plain}), writes, parallel=True)
        written: list[str] = list(plain)
        try:
            for name, st in staged.tensors.items():
                if name in writes:
                    continue
                t = view[name]
                scatter(t, st.positions, st.new, st.old)  # checks old, all or nothing
                written.append(name)
                if not np.array_equal(gather(t, st.positions), st.new):
                    raise TargetMismatchError(
                        "read-back of written weights differs", tensor=name, engine=self.name
                    )
        except BaseException:
            for name in written:
                st = staged.tensors[name]
                scatter(view[name], st.positions, st.old)
            raise

    def audit(self, budget_bytes: int) -> AuditReport:
        """Re-hash up to ``budget_bytes`` of live parameters (one tensor at a time, under the
        forward lock) against the held version's digests; a mismatch sets ``version`` None."""
        view = self.runtime.view
        names, wrapped = self._cursor.take(sorted(view), lambda n: view[n].nbytes, budget_bytes)
        bad: list[str] = []
        nbytes = 0
        for name in names:
            with self.runtime.commit():
                t = view[name]
                live = sum128_digest(t.dtype, t.shape, t.nbytes, sum128(t.data))
                if live != view.tensor_digest(name):
                    bad.append(name)
                    self.rewind.clear()
                    self.runtime.version = None  # unknown bits: out of rotation until re-synced
            nbytes += t.nbytes
        return AuditReport(len(names), nbytes, tuple(bad), wrapped)

    def pause(self) -> None:
        self.runtime.pause()

    def resume(self) -> None:
        self.runtime.resume()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
