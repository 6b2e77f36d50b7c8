"""rollpatch.engines.process.EngineProcess: an engine server as a child process group (the
benches' and the live tests' vLLM and SGLang servers), here with a small stand-in server."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from rollpatch.engines.process import EngineProcess
from rollpatch.errors import EngineError
from tests.vllm_env import free_port

#: Answers /health 200 after ``delay`` s, starts a child of its own (a stand-in for vLLM's
#: engine core), and prints its pid.
SERVER = """
import http.server, subprocess, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
t0 = time.monotonic()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() - t0 > delay
        self.send_response(200 if ok else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def test_ready_on_health_and_stopped_with_its_children(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-c", SERVER, str(port), "0.6"]
    p = EngineProcess(
        cmd, env=os.environ, log=tmp_path / "s.log", url=f"http://127.0.0.1:{port}", name="stand-in"
    )
    try:
        took = p.wait_ready(30)
        assert took >= 0.6  # 503 before its delay: not ready
        child = int(p.tail().split()[1])
        assert _alive(child)
    finally:
        p.stop()
    assert p.proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(child):  # the whole group got the signal
        assert time.monotonic() < deadline, "the server's child outlived stop()"
        time.sleep(0.05)
    p.stop()  # stopped twice: nothing to do


def test_a_server_that_exits_or_never_answers_is_an_engine_error(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    p = EngineProcess(
        cmd, env=os.environ, log=tmp_path / "x.log", url="http://127.0.0.1:9", name="stand-in"
    )
    with pytest.raises(EngineError, match=r"(?s)stand-in exited with 3:.*no model here"):
        p.wait_ready(30)
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    p = EngineProcess(
        cmd, env=os.environ, log=tmp_path / "y.log", url="http://127.0.0.1:9", name="stand-in"
    )
    try:
        with pytest.raises(EngineError, match="not healthy after 1 s"):
            p.wait_ready(1.0)
    finally:
        p.stop()
    assert p.tail(3) == ""  # an empty log
    (tmp_path / "y.log").unlink()
    assert p.tail() == "(no log)"


def test_stop_ends_the_children_of_a_server_that_exited(tmp_path: Path) -> None:
    """A server that died and left its engine core running: stop() still ends the group."""
    orphan = (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']); print('child', c.pid, flush=True); sys.exit(1)"
    )
    p = EngineProcess(
        [sys.executable, "-c", orphan],
        env=os.environ,
        log=tmp_path / "o.log",
        url="http://127.0.0.1:9",
        name="stand-in",
    )
    with pytest.raises(EngineError, match="exited with 1"):
        p.wait_ready(30)
    child = int(p.tail().split()[1])
    assert _alive(child)
    p.stop(timeout=5)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the exited server's child outlived stop()"
        time.sleep(0.05)
