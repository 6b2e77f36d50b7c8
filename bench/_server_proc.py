"""An engine's server process for the benches (vLLM's, SGLang's): rollpatch's
:class:`~rollpatch.engines.process.EngineProcess`, whose start failures end the bench."""

from __future__ import annotations

from rollpatch.engines.process import EngineProcess
from rollpatch.errors import EngineError


class BenchError(SystemExit):
    """A commit, a reload or the server is not what it must be."""


class ServerProc(EngineProcess):
    """:class:`EngineProcess`; a server that exits or is not healthy in time: BenchError."""

    def wait_ready(self, timeout: float = 240.0) -> float:
        try:
            return super().wait_ready(timeout)
        except EngineError as e:
            raise BenchError(str(e)) from e
