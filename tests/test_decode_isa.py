"""The native decoder's vector loops (AVX-512 where the CPU has it) and its scalar ones give
identical decodes: the same transitions decoded in a process with ``ROLLPATCH_ISA=scalar``
and in one with the default, each checked against the numpy reference there, and their
outputs (positions, old and new elements, the written tensor, its rp.sum128 change and
state) compared here byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollpatch import native
from rollpatch.view import _sum128_numpy, sum128

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: every kind, sizes that cover whole 16-change steps, tails and groups
# dense enough to be summed whole (more than one change per 64 elements).
CHILD = r"""
import hashlib, json, sys
import numpy as np
from rollpatch.kinds import KINDS
from rollpatch.patch.codec_v2 import CtxGolombV2
from rollpatch.view import Tensor
from tests.test_patch import _perturb, _words

NATIVE, REF = CtxGolombV2(), CtxGolombV2(reference=True)
out = {}
for name in sorted(KINDS):
    kind = KINDS[name]
    for n, density in ((70_003, 0.002), (70_003, 0.05), (70_003, 0.4), (5_000, 0.9), (40, 0.5)):
        rng = np.random.default_rng(n + int(1000 * density))
        words = n // 2 if kind.packed else n
        a = _words(rng, name, words)
        b = _perturb(rng, name, a, density)
        t, u = Tensor(kind, (a.size,), a), Tensor(kind, (b.size,), b)
        ea, eb = t.elements(), u.elements()
        pos = np.flatnonzero(ea != eb).astype(np.int64)
        if not pos.size:
            continue
        blob = memoryview(NATIVE.encode(t, pos, ea[pos], eb[pos]))
        h = hashlib.sha256()
        for got, want in zip(NATIVE.decode(blob, t, pos.size), (pos, ea[pos], eb[pos])):
            assert np.array_equal(got, want), name
            h.update(got.tobytes())
        w = Tensor(kind, t.shape, t.data.copy())
        p, o, nw, change, state = NATIVE.decode_into_hashed(blob, w, pos.size)
        assert np.array_equal(w.data, u.data), name
        for x in (p, o, nw, w.data):
            h.update(x.tobytes())
        h.update(repr((change, state)).encode())
        out[f"{name}/{n}/{density}"] = h.hexdigest()
json.dump(out, sys.stdout)
"""


def _decodes(isa: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ROLLPATCH_ISA", None)
    if isa:
        env["ROLLPATCH_ISA"] = isa
    r = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, str] = json.loads(r.stdout)
    return result


@pytest.mark.skipif(native.core is None, reason="the native core is not built")
def test_scalar_and_vector_decoders_agree_byte_for_byte() -> None:
    scalar, best = _decodes("scalar"), _decodes(None)
    assert scalar.keys() == best.keys() and len(scalar) > 20
    differ = [k for k in scalar if scalar[k] != best[k]]
    assert not differ, f"scalar and vector decodes differ: {differ}"


@pytest.mark.parametrize("words", [15, 16, 17, 31, 32, 35, 48 + 4 + 3, 1000])
@pytest.mark.parametrize("tail", [0, 3])
def test_sum128_vector_steps_and_tails(words: int, tail: int) -> None:
    """rp.sum128's 16-word (AVX-512), 4-word (AVX2) and scalar parts meet exactly."""
    raw = np.random.default_rng(words).integers(0, 256, 8 * words + tail, dtype=np.uint8)
    assert sum128(raw) == _sum128_numpy(raw)
