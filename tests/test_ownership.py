"""One adapter per engine (rollpatch.engines.ownership) when the owner's process is gone: an
owner killed with no chance to let go (``kill -9``) is found dead in ``/proc`` and the next
adapter takes over at once, not after the lease (a restarted sidecar served about 8 s after
its start); an owner that still runs, or whose token cannot be checked here, keeps the lease.
Real processes, the real ``/proc``; the claims themselves: tests/test_sglang_offline.py and
tests/test_vllm_offline.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rollpatch import liveness
from rollpatch.engines import ownership as own
from rollpatch.errors import EngineError

_TOKEN = "from rollpatch.engines.ownership import owner_token; print(owner_token(), flush=True)"


def _child_token() -> tuple[subprocess.Popen[str], str]:
    """A process that made its owner token and waits (stdin open)."""
    child = subprocess.Popen(
        [sys.executable, "-c", f"{_TOKEN}\nimport sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def test_an_owner_killed_9_lets_go_at_once_one_that_runs_keeps_the_lease() -> None:
    child, token = _child_token()
    try:
        rand, _boot, _ns, pid, _start = token.split(".")
        assert pid == str(child.pid) and len(rand) == 16
        o = own.Ownership()
        assert o.claim(token) is False
        with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
            o.claim(own.owner_token())  # the owner runs: refused within the lease
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)  # reaped: /proc has no such process
        assert o.claim(own.owner_token()) is True  # at once, well within the lease
    finally:
        child.kill()
        child.wait(10)


def test_a_killed_owner_not_yet_reaped_is_gone_too() -> None:
    child, token = _child_token()
    try:
        o = own.Ownership()
        o.claim(token)
        os.kill(child.pid, signal.SIGKILL)
        # not waited for: a zombie until reaped ('Z' in /proc/PID/stat)
        for _ in range(1000):
            stat = liveness._stat(str(child.pid))
            if stat is None or stat[0] in "ZX":
                break
            os.sched_yield()
        assert o.claim(own.owner_token()) is True
    finally:
        child.wait(10)


@pytest.mark.parametrize("where", ["boot", "ns", "start", "short", "plain", "pid"])
def test_a_token_that_cannot_be_checked_here_keeps_the_lease(where: str) -> None:
    """Another kernel (boot id), another PID namespace, a pid now another process's start
    time... only where the token is of this kernel and namespace is a dead pid believed; a
    token without the fields (an older adapter's) keeps the lease; a pid reused by another
    process (start time differs) is the owner gone."""
    me = own.owner_token()
    rand, boot, ns, pid, start = me.split(".")
    token = {
        "boot": f"{rand}.{'0' * len(boot)}.{ns}.999999999.{start}",
        "ns": f"{rand}.{boot}.1.999999999.{start}",
        "start": f"{rand}.{boot}.{ns}.{pid}.{int(start) + 1}",
        "short": f"{rand}.{boot}.{ns}.999999999",
        "plain": rand,
        "pid": f"{rand}.{boot}.{ns}.x1.{start}",
    }[where]
    o = own.Ownership()
    o.claim(token)
    if where == "start":  # this pid runs, but is not the process that made the token
        assert o.claim(own.owner_token()) is True
        return
    with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
        o.claim(own.owner_token())


def test_a_second_sglang_adapter_is_refused_on_the_control_socket(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second sidecar on a driven SGLang was refused only by the loader's claim, which it
    reached through SGLang's weight-update routes: they take SGLang's model-update writer
    lock, so the first sidecar's requests waited 6-28 s at each of its retries (an audit,
    session 40). Now the driving adapter notes its control socket (per server URL) and
    another asks the loader there first (``claimable``: the check alone), never touching
    SGLang's routes while it is refused. A real loader control server on a real socket."""
    import socketserver
    import tempfile
    import threading
    from pathlib import Path

    from rollpatch.engines.sglang import loader, rendezvous

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(loader._STATE, "owner", own.Ownership())
    sock = Path(str(tmp_path)) / "control.sock"
    server = socketserver.UnixStreamServer(str(sock), loader._Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, first, second = "http://localhost:30000", own.owner_token(), own.owner_token()
    try:
        rendezvous.ask(url, second, 5.0)  # nothing noted yet: nothing to say
        loader._STATE.owner.claim(first)
        rendezvous.note(url, sock)
        with pytest.raises(EngineError, match="driven by another rollpatch adapter") as refused:
            rendezvous.ask("http://127.0.0.1:30000/", second, 5.0)  # the same server
        assert refused.value.context["other_adapter"] is True
        assert loader._STATE.owner.owner == first  # asking changed nothing
        rendezvous.ask(url, first, 5.0)  # its own start again: fine
        rendezvous.ask("http://127.0.0.1:30001", second, 5.0)  # another server: nothing noted
        loader._STATE.owner.disown()  # the first let go: a start may go on
        rendezvous.ask(url, second, 5.0)
        rendezvous.forget(url, sock)
        assert not list(Path(str(tmp_path)).glob("rollpatch-*/sglang-*.json"))
        rendezvous.note(url, sock)
    finally:
        server.shutdown()
        server.server_close()
    sock.unlink()
    rendezvous.ask(url, second, 5.0)  # a dead socket says nothing
