"""The native core's many-job calls (``encode_jobs``, ``decode_apply_view``: every (tensor,
range of chunks) on the core's own threads): the same results as one range at a time, for
any thread count and job order, and all or nothing with the first failure in header order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollpatch import native
from rollpatch.errors import PatchDecodeError, RollpatchError
from rollpatch.kinds import KINDS
from rollpatch.patch import apply, apply_encoded, decode, encode_views
from rollpatch.patch.codec_v2 import job_ranges
from rollpatch.patch.ctxv2 import CHUNK
from rollpatch.view import View
from tests.patchfix import reseal, sample_views, split_blob

core = native.require()


def _views(seed: int) -> tuple[View, View]:
    a, b = sample_views(seed=seed, n=3_158_000)  # model.w: 4 chunks
    return View(dict(a)), View(dict(b))


def _pairs(a: View, b: View) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    return [(native.kind_tuple(a[n].kind, a[n].n_elements), a[n].data, b[n].data) for n in a]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_encode_jobs_equal_one_range_at_a_time(threads: int) -> None:
    a, b = _views(0)
    pairs = _pairs(a, b)
    jobs = []
    for i, name in enumerate(a):  # the order of _pairs
        nch = -(-a[name].n_elements // CHUNK)
        jobs += [(i, c, min(c + 2, nch)) for c in range(0, nch, 2)]
    jobs.reverse()  # any order: results are per job
    got = core.encode_jobs(pairs, jobs, threads)
    ws = core.Workspace()
    for (i, c0, c1), (buf, k, d0, d1) in zip(jobs, got, strict=True):
        kt, x, y = pairs[i]
        want = core.encode_range_buf(kt, x, y, c0, c1, ws)
        assert (bytes(buf), k, d0, d1) == (bytes(want[0]), *want[1:])


def test_encode_jobs_refuses_bad_arguments() -> None:
    a, b = _views(1)
    pairs = _pairs(a, b)
    with pytest.raises(ValueError):
        core.encode_jobs(pairs, [(len(pairs), 0, 1)], 2)  # no such pair
    with pytest.raises(ValueError):
        core.encode_jobs(pairs, [(0, 0, 99)], 2)  # beyond the tensor's chunks
    kt, x, _ = pairs[0]
    with pytest.raises(ValueError):
        core.encode_jobs([(kt, x, x[:-1])], [(0, 0, 1)], 2)  # sizes differ
    assert core.encode_jobs(pairs, [], 2) == []


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_encode_view_equals_each_tensor_whole(threads: int) -> None:
    """encode_view (the jobs cut, run and joined in C) gives each pair what one range over
    the whole tensor gives, for per-thread job counts that cut tensors into 1 to 4 ranges."""
    a, b = _views(2)
    pairs = _pairs(a, b)
    ws = core.Workspace()
    want = []
    for (kt, x, y), name in zip(pairs, a, strict=True):  # the order of _pairs
        nch = -(-a[name].n_elements // CHUNK)
        buf, k, d0, d1 = core.encode_range_buf(kt, x, y, 0, nch, ws)
        want.append((bytes(buf), k, d0, d1))
    for per in (1, 4, 64):
        got = core.encode_view(pairs, threads, per)
        assert [(bytes(buf), k, d0, d1) for buf, k, d0, d1 in got] == want


def test_encode_view_refuses_bad_arguments() -> None:
    a, b = _views(3)
    pairs = _pairs(a, b)
    kt, x, _ = pairs[0]
    with pytest.raises(ValueError):
        core.encode_view([(kt, x, x[:-1])], 2, 4)  # sizes differ
    with pytest.raises(ValueError):
        core.encode_view(pairs, 0, 4)
    with pytest.raises(ValueError):
        core.encode_view(pairs, 2, 0)
    assert core.encode_view([], 2, 4) == []
    empty = x[:0]
    assert [tuple(r) for r in core.encode_view([(kt, empty, empty)], 2, 4)] == [(b"", 0, 0, 0)]


def _decode_args(
    a: View, blob: bytes, step: int = 1, lie: int = 0
) -> tuple[View, list[tuple[Any, ...]], list[int]]:
    """One decode_apply_view entry per v2 delta of ``blob`` (as inplace._write_concurrently
    builds them), jobs of ``step`` chunks; ``lie`` is added to each header count."""
    from rollpatch.patch.header import inspect

    h = inspect(blob)
    v = a.copy()
    tensors, nch = [], []
    for e in h.tensors:
        if e["op"] != "delta" or e["codec"] != "rp.ctxgolomb.v2":
            continue
        t = v[e["name"]]
        start = h.payload_start + e["offset"]
        payload = memoryview(blob)[start : start + e["length"]]
        kt = native.kind_tuple(t.kind, t.n_elements)
        k = e["changed"] + lie
        pos, old, new = (
            np.empty(k, np.int64),
            np.empty(k, t.kind.elem_dtype),
            np.empty(k, t.kind.elem_dtype),
        )
        tensors.append((kt, t.data, payload, k, step, pos, old, new))
        nch.append(-(-t.n_elements // CHUNK))
    return v, tensors, nch


def _unchanged(v: View, a: View) -> bool:
    return all(np.array_equal(v[n].data, a[n].data) for n in a)


def test_decode_apply_view_refuses_bad_arguments_before_writing() -> None:
    a, b = _views(2)
    v, tensors, _ = _decode_args(a, encode_views(a, b))
    failed = np.full(1, -1, dtype=np.int64)
    kt, data, payload, k, _, pos, old, new = tensors[-1]
    for bad in (
        (kt, data, payload, k, 0, pos, old, new),  # no chunks per job
        (kt, data, payload, k, 1, pos[:-1], old, new),  # outputs not `changed` long
        (kt, data, payload, k, 1, pos, old, new[:-1]),
        (kt, data, payload, k + 1, 1, pos, old, new),
        (kt, data, payload, data.size * 2 + 1, 1, pos, old, new),  # beyond the tensor
        (kt, data[:-1].copy(), payload, k, 1, pos, old, new[:-1]),
    ):
        with pytest.raises(ValueError):
            core.decode_apply_view([*tensors[:-1], bad], 2, True, failed)
        assert _unchanged(v, a) and failed[0] == -1
    assert core.decode_apply_view([], 2, True, failed) == []


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("step", [1, 2, 64, 1 << 62])
def test_decode_apply_view_sums_to_one_pass_per_tensor(threads: int, step: int) -> None:
    """Split into jobs of ``step`` chunks: the same words, outputs, change and in-pass hash
    per tensor as one decode_range over each whole tensor."""
    a, b = _views(3)
    blob = encode_views(a, b)
    v, tensors, nch = _decode_args(a, blob, step)
    w, tensors1, _ = _decode_args(a, blob)
    res = core.decode_apply_view(tensors, threads, True, np.full(1, -1, dtype=np.int64))
    for i, (kt, data, payload, _, _, pos, old, new) in enumerate(tensors1):
        counts = core.table(kt, payload, data.size * 2 if kt[0] == 4 else data.size)
        offs = np.cumsum([0, *counts]).tolist()
        want = core.decode_range(
            kt, data, payload, 0, nch[i], counts, offs[:-1], pos, old, new, True, True
        )
        assert res[i] == want
        assert all(np.array_equal(x, y) for x, y in zip(tensors[i][5:], tensors1[i][5:]))
    assert _unchanged(v, b) and _unchanged(w, b)


@pytest.mark.parametrize("lie", [-1, 1])
def test_decode_apply_view_refuses_a_false_count_with_every_word_in_place(lie: int) -> None:
    """Every tensor's count is checked against its chunks' before any job runs; the first
    tensor (header order) is the one named, whatever the others' jobs did."""
    a, b = _views(4)
    v, tensors, _ = _decode_args(a, encode_views(a, b))
    kt, data, payload, k, step, _, old, _ = tensors[-1]
    n = k + lie
    dt = old.dtype
    tensors[-1] = (
        kt,
        data,
        payload,
        n,
        step,
        np.empty(n, np.int64),
        np.empty(n, dt),
        np.empty(n, dt),
    )
    failed = np.full(1, -1, dtype=np.int64)
    with pytest.raises(PatchDecodeError, match="changed count does not match the header"):
        core.decode_apply_view(tensors, 3, True, failed)
    assert failed[0] == len(tensors) - 1
    assert _unchanged(v, a)


def test_a_delta_of_an_empty_tensor_decodes_as_no_change() -> None:
    """No chunks: an empty payload and a count of 0 (as the numpy reference reads it); any
    byte of payload is a corrupt table."""
    t = np.empty(0, dtype=np.uint16)
    kt = native.kind_tuple(KINDS["bf16"], 0)
    assert core.table(kt, b"", 0) == []
    with pytest.raises(PatchDecodeError):
        core.table(kt, b"\x00", 0)
    out = (np.empty(0, np.int64), np.empty(0, np.uint16), np.empty(0, np.uint16))
    failed = np.full(1, -1, dtype=np.int64)
    assert core.decode_apply_view([(kt, t, b"", 0, 1, *out)], 2, True, failed) == [(0, 0, 0, 0)]
    with pytest.raises(PatchDecodeError):
        core.decode_apply_view([(kt, t, b"\x00", 0, 1, *out)], 2, True, failed)
    assert failed[0] == 0


def _decode_error_flip(a: View, header: dict, payload: bytes, name: str) -> int:
    """A byte of ``name``'s payload whose flip makes ``decode`` refuse that tensor (found
    from the end: the last chunk's streams)."""
    e = next(t for t in header["tensors"] if t["name"] == name)
    for back in range(1, e["length"]):
        body = bytearray(payload)
        body[e["offset"] + e["length"] - back] ^= 0x5A
        try:
            decode(reseal(header, bytes(body)), a)
        except RollpatchError as err:
            if err.context.get("tensor") == name:
                return e["offset"] + e["length"] - back
    raise AssertionError(f"no flip of {name} is refused by decode")


def _table_error_flip(header: dict, name: str) -> int:
    """The first byte of ``name``'s payload: its first chunk's length, now beyond the payload."""
    return int(next(t for t in header["tensors"] if t["name"] == name)["offset"])


@pytest.mark.parametrize("first", ["decode", "table"])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_two_corrupt_tensors_raise_as_decode_does_with_every_word_in_place(
    first: str, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.q (one chunk, first in header order) and model.w (four chunks: its jobs run
    first) both refused, one at its chunk table (checked before any job runs), the other in
    its streams: the error is the one ``decode`` raises (header order), nothing stays
    written."""
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    a, b = _views(4)
    header, payload = split_blob(encode_views(a, b))
    body = bytearray(payload)
    q_dec = (_decode_error_flip(a, header, payload, "model.q"), 0x5A)
    q_tab = (_table_error_flip(header, "model.q"), 0xFF)
    w_dec = (_decode_error_flip(a, header, payload, "model.w"), 0x5A)
    w_tab = (_table_error_flip(header, "model.w"), 0xFF)
    for at, mask in (q_dec, w_tab) if first == "decode" else (q_tab, w_dec):
        body[at] ^= mask
    bad = reseal(header, bytes(body))
    raised = []
    for fn in (lambda v, blob: apply(v, decode(blob, v)), apply_encoded):
        v = a.copy()
        with pytest.raises(RollpatchError) as err:
            fn(v, bad)
        raised.append((type(err.value), err.value.context.get("tensor"), err.value.message))
        assert all(np.array_equal(v[n].data, a[n].data) for n in a)
        v.invalidate()
        assert v.digest() == a.digest()
    assert raised[0] == raised[1]
    assert raised[0][1] == "model.q"


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_job_ranges_cover_every_chunk_once_in_order(threads: int) -> None:
    for nch in (0, 1, 2, 3, 7, 20, 101):
        r = job_ranges(nch, threads)
        assert [c for a, b in r for c in range(a, b)] == list(range(nch))
        assert all(b > a for a, b in r)
        if threads == 1:
            assert len(r) == (1 if nch else 0)
