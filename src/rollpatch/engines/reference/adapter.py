"""The reference engine adapter: the follower commits into a :class:`ReferenceRuntime`.

In process: the adapter writes the runtime's in-place view (the model's own parameter memory)
under the runtime's forward lock, and serves generation over HTTP with
:func:`~rollpatch.engines.reference.server.serve` so the sidecar can proxy to :attr:`url`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import BaseMismatchError, EngineError
from ...patch import Patch, apply
from ...view import Tensor, View, WordSource
from ..base import EngineAdapter
from .runtime import ReferenceRuntime
from .server import ServerHandle, serve

__all__ = ["ReferenceEngine"]


def _check_layout(view: View, patch: Patch) -> None:
    """A model's tensor set is fixed: refuse drops, new tensors and layout changes up front."""
    for name, tp in patch.tensors.items():
        if tp.op == "drop" or name not in view:
            raise BaseMismatchError("patch adds or drops a tensor; the model cannot change shape",
                                    tensor=name, op=tp.op,
                                    hint="self-heal from a keyframe of this architecture")
        t = view[name]
        if tp.op == "full" and tp.tensor is not None and (
                tp.tensor.dtype != t.dtype or tp.tensor.shape != t.shape):
            raise BaseMismatchError("patch changes a tensor's layout", tensor=name,
                                    dtype=tp.tensor.dtype, shape=tp.tensor.shape)


class ReferenceEngine(EngineAdapter):
    """:class:`EngineAdapter` over a :class:`ReferenceRuntime` in this process.

    ``apply`` runs :func:`rollpatch.patch.apply` on the in-place view under the forward lock
    (between forward passes, or while paused): verified, rolled back on failure, and the
    runtime's ``version`` moves only on success. There are no prefix or KV caches shared
    across requests, so a commit has nothing to flush; a request in flight during a paused
    commit keeps its own KV cache and reports ``version_start != version_end``.
    """

    name = "reference"

    def __init__(self, runtime: ReferenceRuntime, *, serve_http: bool = True,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.runtime = runtime
        self._server: ServerHandle | None = serve(runtime, host, port) if serve_http else None

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: str = "bfloat16",
                 threads: int | None = None, serve_http: bool = True, host: str = "127.0.0.1",
                 port: int = 0) -> ReferenceEngine:
        """Load a Hugging Face causal LM directory and (by default) serve it."""
        runtime = ReferenceRuntime(model_dir, dtype=dtype, threads=threads)
        return cls(runtime, serve_http=serve_http, host=host, port=port)

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
            raise EngineError("engine is not serving HTTP", engine=self.name,
                              hint="construct with serve_http=True")
        return self._server.url

    def load(self, view: View, version: int) -> None:
        self.runtime.load_view(view, version)

    def words(self) -> WordSource:
        return self.runtime.view

    def apply(self, patch: Patch, version: int) -> None:
        with self.runtime.commit() as view:
            _check_layout(view, patch)
            bound: dict[str, Tensor] = {n: view[n] for n in patch.tensors}
            apply(view, patch)  # verified; on failure the words are restored and it raises
            self._rebind(view, patch, bound)
            self.runtime.version = version

    def _rebind(self, view: View, patch: Patch, bound: dict[str, Tensor]) -> None:
        """``full`` ops replace Tensor objects; copy them back into the parameter memory."""
        for name, tp in patch.tensors.items():
            if view[name] is bound[name]:
                continue
            np.copyto(bound[name].data, view[name].data)
            view[name] = bound[name]
            if view.tensor_digest(name) != tp.target_digest:
                self.runtime.version = None  # unknown bits: not ready, never a wrong version
                raise EngineError("parameter differs from the target after copying",
                                  tensor=name, engine=self.name)

    def pause(self) -> None:
        self.runtime.pause()

    def resume(self) -> None:
        self.runtime.resume()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
