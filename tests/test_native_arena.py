"""The encoder's arena (``core.encode_view_arena``: every payload at its offset in one native
buffer, in pair order) and ``join_release`` copying such a buffer out while giving its pages
back: the same payloads as ``encode_view``, and an encode that never holds the payloads and
the patch whole at once."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from rollpatch import native
from rollpatch.kinds import KINDS
from rollpatch.view import Tensor, View
from tests.patchfix import sample_views

core = native.require()


def _pairs(a: View, b: View) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    return [(native.kind_tuple(a[n].kind, a[n].n_elements), a[n].data, b[n].data) for n in a]


def _views() -> tuple[View, View]:
    """sample_views' tensors (model.w: 4 chunks), one more left unchanged and an empty one."""
    a, b = sample_views(seed=5, n=3_158_000)
    a, b = dict(a), dict(b)
    same = np.arange(1 << 21, dtype=np.uint16)
    a["same"] = Tensor(KINDS["bf16"], same.shape, same)
    b["same"] = Tensor(KINDS["bf16"], same.shape, same.copy())
    empty = np.zeros(0, dtype=np.uint16)
    a["empty"] = Tensor(KINDS["bf16"], (0,), empty)
    b["empty"] = Tensor(KINDS["bf16"], (0,), empty.copy())
    return View(a), View(b)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_arena_holds_encode_view_payloads_in_pair_order(threads: int) -> None:
    """Each pair's payload is encode_view's, at consecutive offsets; a pair with no change
    (and an empty one) has an empty payload and leaves no bytes in the arena."""
    a, b = _views()
    pairs = _pairs(a, b)
    for per in (1, 4, 64):
        want = core.encode_view(pairs, threads, per)
        arena, got = core.encode_view_arena(pairs, threads, per)
        data, at = bytes(arena), 0
        for (buf, k, d0, d1), (off, n, k2, e0, e1) in zip(want, got, strict=True):
            assert (off, k2, e0, e1) == (at, k, d0, d1)
            assert data[off : off + n] == (bytes(buf) if k else b"")
            at += n
        assert at == len(data) == len(arena)
        names = list(a)
        for name in ("same", "empty"):
            assert got[names.index(name)][1:3] == (0, 0)


def test_arena_refuses_bad_arguments() -> None:
    a, b = _views()
    pairs = _pairs(a, b)
    kt, x, _ = pairs[0]
    with pytest.raises(ValueError):
        core.encode_view_arena([(kt, x, x[:-1])], 2, 4)  # sizes differ
    with pytest.raises(ValueError):
        core.encode_view_arena(pairs, 0, 4)
    with pytest.raises(ValueError):
        core.encode_view_arena(pairs, 2, 0)
    arena, got = core.encode_view_arena([], 2, 4)
    assert (bytes(arena), got) == (b"", [])


def _arena() -> Any:
    a, b = _views()
    arena, _ = core.encode_view_arena(_pairs(a, b), 2, 4)
    assert len(arena) > 128 << 10  # mapped, several 64 KiB pieces: drained in pieces
    return arena


def test_join_release_drains_an_arena_only_the_list_holds() -> None:
    arena = _arena()
    want = b"head" + bytes(arena)
    pieces = [b"head", arena]
    del arena
    assert core.join_release(pieces) == want
    assert pieces == [None, None]


def test_join_release_copies_an_arena_still_viewed_or_held() -> None:
    """A buffer with a view of it out, or held elsewhere too, is copied and left whole."""
    arena = _arena()
    want = bytes(arena)
    view = memoryview(arena)[8:]
    pieces = [arena]
    del arena
    assert core.join_release(pieces) == want
    assert view.tobytes() == want[8:]  # still readable: not given back
    view.release()
    arena = _arena()
    want = bytes(arena)
    assert core.join_release([b"", arena]) == want
    assert bytes(arena) == want


_MEASURE = """
import ctypes, gc, os
os.environ["ROLLPATCH_THREADS"] = "1"
import numpy as np
from rollpatch.kinds import KINDS
from rollpatch.patch import encode_views
from rollpatch.view import Tensor, View

def kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

rng = np.random.default_rng(0)
n, m = 1 << 16, 512  # many small payloads: C heap blocks, not mappings of their own
words = rng.integers(0, 1 << 16, n * m, np.uint16)
a = View({f"w{i:04d}": Tensor(KINDS["bf16"], (n,), words[i * n : (i + 1) * n]) for i in range(m)})
b = a.copy()
for name in b:
    b[name].data[::5] ^= 1
b.invalidate()
a.digest()
blob = encode_views(a, b)  # the process's one-time state: header context, thread pool
blob = b""
gc.collect()
gc.disable()
b.invalidate()
ctypes.CDLL(None).malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss0 = kb("VmRSS")
blob = encode_views(a, b)
print((kb("VmHWM") - rss0) * 1024, len(blob))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM, clear_refs: Linux")
def test_encode_never_holds_payloads_and_patch_whole() -> None:
    """Peak RSS growth of an encode (views resident, C heap trimmed, collector off) stays well
    under payloads + patch (2x the patch, what joining separate payloads costs): the arena
    is given back as the patch is filled. 512 tensors of 4.7 KB payloads each: 1.19x
    measured (separate payloads joined: 2.17x). In a fresh process, so that no earlier test's memory is
    reused unseen or left backed by huge pages (numpy asks for them over large arrays; memory
    the C heap hands out again from such a range becomes resident 2 MiB at a time); the
    one-time state (header context, thread pool) is set up by a first encode of the views."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no clear_refs here")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    grown, size = map(int, out.stdout.split())
    assert size > 4 << 20  # 4.8 MB
    assert grown < 1.6 * size, (grown, size, os.getloadavg())
