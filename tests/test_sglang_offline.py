"""SGLang's in-place extension offline (numpy, torch; a real SGLang: tests/test_sglang.py):
the command payload is byte for byte what torch's own pickler writes for an empty tensor;
staging proves a patch without writing, commits scatter and read back, double-buffered commits
exchange storage, and every refusal leaves the words untouched (fused qkv / gate_up and
vocabulary layouts); the audit finds a flipped word.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.sglang.staged import HeldWeights
from rollpatch.engines.sglang.wire import command_payload
from rollpatch.errors import (
    BaseMismatchError,
    EngineError,
    PatchError,
    TargetMismatchError,
    ViewError,
)
from rollpatch.kinds import get_kind
from rollpatch.patch import FullOp, Patch, diff
from rollpatch.view import View
from tests import vllm_layouts

# -- offline ----------------------------------------------------------------------------------


def test_command_payload_is_torchs_own_bytes() -> None:
    """The hand-written payload equals torch's ForkingPickler output for the same list."""
    torch = pytest.importorskip("torch")
    import base64
    from multiprocessing.reduction import ForkingPickler

    importlib.import_module("torch.multiprocessing")  # registers torch's reductions
    for cmd in (
        {"op": "start", "socket": "/tmp/x.sock"},
        {"op": "commit", "token": "ab" * 8, "reply": "/tmp/é/r.json"},
    ):
        name = json.dumps(cmd, separators=(",", ":"), sort_keys=True)
        buf = io.BytesIO()
        ForkingPickler(buf, 2).dump([(name, torch.empty(0, dtype=torch.uint8))])
        assert base64.b64decode(command_payload(cmd)) == buf.getvalue()


def _held(seed: int = 0) -> tuple[HeldWeights, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A one-layer fused layout (qkv, gate_up, vocab...) at TP 1 over numpy parameters."""
    specs = vllm_layouts.layer_specs(1)
    ck = vllm_layouts.checkpoint(seed)
    params = {
        s.param: vllm_layouts.vllm_load(ck, 1, 0)[s.param]
        .reshape(vllm_layouts.param_shape(s, 1))
        .copy()
        for s in specs
    }
    kinds = {s.param: get_kind("bf16") for s in specs}
    return HeldWeights(params, specs, kinds), params, ck


def test_staged_commit_scatters_only_after_proof() -> None:
    w, params, ck = _held()
    a = vllm_layouts.words_view(ck)
    assert w.root() == a.digest() and w["q_proj.weight"].data.base is not None  # zero-copy
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 1))
    before = {p: v.copy() for p, v in params.items()}
    staged = w.stage(diff(a, b))
    assert all(np.array_equal(before[p], params[p]) for p in params)  # staging writes nothing
    assert staged.changed > 0 and w.root() == a.digest()
    w.commit(staged.token)
    assert w.root() == b.digest() and w.digests(fresh=True) == b.tensor_digests()
    with pytest.raises(EngineError, match="no staged update"):
        w.commit(staged.token)  # one commit per staged update
    w.commit(w.stage(diff(b, a)).token)  # and back
    assert all(np.array_equal(before[p], params[p]) for p in params)


def _past_the_end(tp: Any) -> np.ndarray:
    """The tensor patch's positions with the last one moved past the tensor's end."""
    pos = tp.changes().positions.copy()
    pos[-1] = int(np.prod(tp.shape))
    return pos


def test_refusals_leave_the_words_untouched() -> None:
    w, params, ck = _held()
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 2))
    snap = {p: v.copy() for p, v in params.items()}
    good = diff(a, b)

    def tampered(target_digest: str | None = None, **change: Any) -> Patch:
        name = "gate_proj.weight"
        tp = good.tensors[name]
        tp = dataclasses.replace(
            tp,
            target_digest=target_digest or tp.target_digest,
            change=dataclasses.replace(tp.changes(), **change),
        )
        return Patch(good.base, good.target, {**good.tensors, name: tp}, {})

    new = good.tensors["gate_proj.weight"].changes().new
    cases = [
        (tampered(new=new ^ np.uint16(1)), TargetMismatchError),  # other bits than the target
        (tampered(target_digest="0" * 64), TargetMismatchError),
        (tampered(old=new), BaseMismatchError),  # old words are not held
        (
            tampered(positions=good.tensors["gate_proj.weight"].changes().positions[::-1].copy()),
            PatchError,
        ),  # unsorted positions
        (tampered(positions=_past_the_end(good.tensors["gate_proj.weight"])), PatchError),
        (diff(b, a), BaseMismatchError),  # another base
    ]
    for patch, err in cases:
        with pytest.raises(err):
            w.stage(patch)
        assert all(np.array_equal(snap[p], params[p]) for p in params)
        assert w.root() == a.digest()
    staged = w.stage(good)
    params["norm.weight"][0, 0] ^= 1  # the engine moved behind the staged update's back
    w._digests.pop("norm.weight")
    with pytest.raises(BaseMismatchError):
        w.commit(staged.token)
    params["norm.weight"][0, 0] ^= 1
    w._digests.pop("norm.weight")
    with pytest.raises(ViewError):
        w.load(View({n: t for n, t in a.items() if n != "norm.weight"}))
    assert w.load(b) == b.digest() and w.digests(fresh=True) == b.tensor_digests()


class NumpyBuffers:
    """The double-buffered commit's glue over numpy arrays (the storage is the array)."""

    def __init__(self, params: dict[str, np.ndarray], fail_on: str | None = None) -> None:
        self.params, self.fail_on, self.exchanges = params, fail_on, 0

    def empty(self, param: str) -> tuple[np.ndarray, np.ndarray]:
        fresh = np.empty_like(self.params[param])
        fresh.fill(0x7FC1)  # not the words: staging must write every one of them
        return fresh, fresh

    def exchange(self, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        held: dict[str, np.ndarray] = {}
        try:
            for name, t in buffers.items():
                if name == self.fail_on:
                    raise RuntimeError(f"exchange of {name} failed")
                held[name], self.params[name] = self.params[name], t
        except BaseException:
            self.params.update(held)
            raise
        self.exchanges += 1
        return held

    def words(self, param: str) -> np.ndarray:
        return self.params[param]


def _held_buffered(
    fail_on: str | None = None,
) -> tuple[HeldWeights, NumpyBuffers, dict[str, np.ndarray]]:
    specs = vllm_layouts.layer_specs(1)
    ck = vllm_layouts.checkpoint(0)
    params = {
        s.param: vllm_layouts.vllm_load(ck, 1, 0)[s.param]
        .reshape(vllm_layouts.param_shape(s, 1))
        .copy()
        for s in specs
    }
    buf = NumpyBuffers(params, fail_on)
    kinds = {s.param: get_kind("bf16") for s in specs}
    return HeldWeights(dict(params), specs, kinds, buffers=buf), buf, ck


def test_double_buffered_commit_exchanges_storage() -> None:
    """Staging builds the touched parameters' second buffers (the live words untouched); the
    commit only exchanges storages, giving the same words as an in-place commit."""
    w, buf, ck = _held_buffered()
    ref, _, _ = _held()
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 1))
    live = dict(buf.params)
    snap = {p: v.copy() for p, v in live.items()}
    staged = w.stage(diff(a, b), "double_buffer")
    assert staged.buffers and set(staged.buffers) == set(staged.writes)
    assert all(np.array_equal(snap[p], buf.params[p]) for p in snap)  # nothing live written
    assert all(buf.params[p] is live[p] for p in live) and w.root() == a.digest()
    assert set(w.last_stage_ms) == {"prove", "layout", "buffers"}
    w.commit(staged.token)
    assert buf.exchanges == 1 and set(staged.retired) == set(staged.writes)
    assert all(staged.retired[p] is live[p] for p in staged.retired)  # the old storage, back
    assert all(np.array_equal(snap[p], live[p]) for p in live)  # ... and never written
    ref.commit(ref.stage(diff(a, b)).token)
    assert w.root() == b.digest() and w.digests(fresh=True) == b.tensor_digests()
    assert all(np.array_equal(w.params[p], ref.params[p]) for p in ref.params)
    assert all(w.params[p] is buf.params[p] for p in buf.params)  # the words re-aliased
    w.commit(w.stage(diff(b, a), "double_buffer").token)  # and back
    assert w.digests(fresh=True) == a.tensor_digests()


def test_double_buffered_refusals_leave_the_storage() -> None:
    """A failed exchange is undone (old storage, old digests); without the glue, or with an
    unknown mode, double-buffered staging is refused."""
    w, buf, ck = _held_buffered(fail_on="gate_up_proj.weight")
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 3))
    live = dict(buf.params)
    staged = w.stage(diff(a, b), "double_buffer")
    with pytest.raises(RuntimeError, match="exchange"):
        w.commit(staged.token)
    assert all(buf.params[p] is live[p] for p in live) and buf.exchanges == 0
    assert w.root() == a.digest() and w.digests(fresh=True) == a.tensor_digests()
    plain, _, _ = _held()
    with pytest.raises(EngineError, match="double-buffered"):
        plain.stage(diff(a, b), "double_buffer")
    with pytest.raises(ValueError, match="mode"):
        plain.stage(diff(a, b), "twice")  # type: ignore[arg-type]


def test_second_buffers_are_the_live_words_with_the_writes_checked() -> None:
    """``second_buffers`` fills the glue's fresh storage in one pass: every word the live
    parameter's except the writes; an old word that differs, or storage of another layout,
    is refused, and the live words are only read."""
    from rollpatch.engines.sglang.buffers import second_buffers
    from rollpatch.engines.writing import ParamWrites

    w, buf, ck = _held_buffered()
    a = vllm_layouts.words_view(ck)
    staged = w.stage(diff(a, vllm_layouts.words_view(vllm_layouts.random_step(ck, 2))))
    snap = {p: v.copy() for p, v in buf.params.items()}
    got = second_buffers(buf, buf.params, staged.writes)
    for p, wr in staged.writes.items():
        want = snap[p].reshape(-1).copy()
        want[wr.prepared] = wr.new
        assert np.array_equal(got[p].reshape(-1), want), p
    p, wr = next(iter(staged.writes.items()))
    bad = wr.old.copy()
    bad[-1] ^= 1
    with pytest.raises(BaseMismatchError, match="old words"):
        second_buffers(buf, buf.params, {p: ParamWrites(wr.prepared, bad, wr.new)})
    wrong = NumpyBuffers(buf.params)
    wrong.empty = lambda q: (np.empty(3, np.uint16),) * 2  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="layout"):
        second_buffers(wrong, buf.params, staged.writes)
    assert all(np.array_equal(snap[q], buf.params[q]) for q in snap)


def test_merge_writes_joins_in_offset_order() -> None:
    """Row blocks that follow one another are joined as they are; interleaved parts sorted;
    both give the offsets in increasing order with their words."""
    from rollpatch.engines.sglang.update import merge_writes

    rng = np.random.default_rng(5)

    def part(lo: int, hi: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        off = np.sort(rng.choice(np.arange(lo, hi), n, replace=False)).astype(np.int64)
        return off, (off % 65536).astype(np.uint16), ((off + 1) % 65536).astype(np.uint16)

    blocks = [part(200, 300, 30), part(0, 100, 20), part(100, 200, 0), part(300, 400, 5)]
    mixed = [part(0, 400, 40), part(0, 400, 0)]
    mixed.append(part(0, 400, 40))
    for parts in (blocks, mixed):
        (w,) = merge_writes({"p": parts}).values()
        want = np.concatenate([q[0] for q in parts])
        order = np.argsort(want, kind="stable")
        assert np.array_equal(w.prepared, want[order])
        assert np.array_equal(w.old, (w.prepared % 65536).astype(np.uint16))
        assert np.array_equal(w.new, ((w.prepared + 1) % 65536).astype(np.uint16))


def test_audit_finds_a_flipped_word() -> None:
    w, params, _ = _held()
    w.digests()
    assert not any(w.audit(1 << 30)["mismatched"])
    params["down_proj.weight"][3, 5] ^= 0x40
    seen: list[str] = []
    for _ in range(len(w.names())):
        seen += w.audit(1)["mismatched"]  # one tensor per slice
    assert seen == ["down_proj.weight"]


@pytest.mark.parametrize("mode", ["in_place", "double_buffer"])
def test_a_chain_is_decoded_in_place_inside_the_engine(tmp_path: Any, mode: str) -> None:
    """The control thread's ``stage_encoded`` takes a chain of published steps (each its
    objects' files, base and target): every touched tensor decoded step after step in one
    private copy, the composed change proven and staged; the commit reaches the last step's
    version. One step decodes as before; a step in another codec, or a chain that does not
    start at the held version, is refused with nothing written."""
    from rollpatch.engines.sglang.loader import _stage_encoded
    from rollpatch.patch.wire import encode, encode_views

    w, buf, ck = _held_buffered()
    views, cks = [vllm_layouts.words_view(ck)], [ck]
    for seed in range(1, 5):
        cks.append(vllm_layouts.random_step(cks[-1], seed))
        views.append(vllm_layouts.words_view(cks[-1]))

    def step(k: int, blob: bytes | None = None) -> dict[str, Any]:
        path = tmp_path / f"s{k}.patch"
        path.write_bytes(blob if blob is not None else encode_views(views[k - 1], views[k]))
        return {"paths": [str(path)], "base": views[k - 1].digest(), "target": views[k].digest()}

    snap = {p: v.copy() for p, v in buf.params.items()}
    with pytest.raises(BaseMismatchError):
        _stage_encoded(w, [step(2), step(3)], mode)  # the engine holds v0, not v1
    full = diff(views[1], views[2])  # a step with one tensor shipped whole: another codec
    name = min(full.tensors)
    whole = FullOp(views[2][name].copy())
    full.tensors[name] = dataclasses.replace(full.tensors[name], change=whole)
    with pytest.raises(PatchError, match="in-place codec"):
        _stage_encoded(w, [step(1), step(2, encode(full, views[1]))], mode)
    assert all(np.array_equal(snap[p], buf.params[p]) for p in snap)
    got = _stage_encoded(w, [step(k) for k in range(1, 5)], mode)
    assert got["base"] == views[0].digest() and got["target"] == views[4].digest()
    assert all(np.array_equal(snap[p], buf.params[p]) for p in snap)  # staged: nothing written
    w.commit(str(got["token"]))
    assert w.root() == views[4].digest() and w.digests(fresh=True) == views[4].tensor_digests()
    back = tmp_path / "back.patch"
    back.write_bytes(encode_views(views[4], views[3]))
    spec = {"paths": [str(back)], "base": views[4].digest(), "target": views[3].digest()}
    one = _stage_encoded(w, [spec], mode)
    w.commit(str(one["token"]))
    assert w.digests(fresh=True) == views[3].tensor_digests()


def test_one_adapter_drives_a_loader_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sidecars on one SGLang: the second's start is refused while the first calls; once
    the first closed (disown), or fell silent for the lease, the second takes over, and the
    first's calls are refused from then on (``taken_over``: its version is void)."""
    from rollpatch.engines import ownership as own

    clock = [100.0]
    monkeypatch.setattr(own, "_clock", lambda: clock[0])
    o = own.Ownership()
    assert o.claim("a") is False  # the first: nothing to take over
    assert o.claim("a") is False  # its own restart of the control threads
    o.check("a")
    clock[0] += own.LEASE_S - 1
    with pytest.raises(EngineError, match="driven by another rollpatch adapter") as refused:
        o.claim("b")
    assert refused.value.context["other_called_s_ago"] == own.LEASE_S - 1
    o.check("a")  # a call renews the lease
    clock[0] += own.LEASE_S + 0.1  # then silence: b takes over
    assert o.claim("b") is True
    with pytest.raises(EngineError, match="took this SGLang over") as displaced:
        o.check("a")
    assert displaced.value.context["taken_over"] is True
    with pytest.raises(EngineError):
        o.check(None)  # a call without a token is no owner's
    assert o.disown() == {"disowned": True} and o.owner is None
    assert o.claim("c") is False  # after a close: at once, and nothing voided
