"""Inside SGLang: rollpatch's custom weight loader and its control thread.

Start SGLang with ``--custom-weight-loader rollpatch.engines.sglang.loader.rollpatch_weight_loader``.
SGLang imports this module in its scheduler process the first time the adapter names the
loader in ``POST /update_weights_from_tensor`` and calls :func:`rollpatch_weight_loader`
there, between two forward passes, with the command the adapter sent (:mod:`.wire`):

- ``start``: build the rank's :class:`~.staged.HeldWeights` from the model's own metadata
  (:mod:`.describe`) and start the control thread on the given UNIX socket;
- ``commit``: scatter a staged update and read it back (the only work under the pause);
- ``undo`` (TP > 1): write the last commit's old words back, when another rank's failed;
- ``load``: overwrite every tensor with a keyframe file, verified;
- ``flip`` (drills and tests only, refused unless SGLang was started with
  ``ROLLPATCH_FAULT_INJECTION=1``): flip the lowest bit of one word behind every digest.

The control thread serves, *while SGLang generates*, what only reads: ``info``, ``digest``,
``stage_encoded`` (decode a wire-format patch against the live words and prove it),
``stage_decoded`` (decoded-patch files, :mod:`rollpatch.engines.vllm.transfer`: one, or the
parts the owner ranks decoded), ``export`` (one tensor to a file; at TP > 1 a rank's block,
or copied into the adapter's shared buffer), at TP > 1 ``export_blocks`` and
``decode_owned`` (a chain decoded by the rank that owns each tensor, :mod:`.owned`),
``audit`` (re-hash a slice of the weights), ``drop`` (a staged
update), ``release`` (TP > 1: the storage a double-buffered commit replaced, once every rank
committed).
Every answer is a JSON dict: ``ok`` plus results, or ``error`` with the rollpatch exception
class, message and context. The loader itself never raises into SGLang.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, PatchError, RollpatchError, error_report
from ...io.safetensors import load_view, save_view
from ...patch import Patch, TensorPatch, decode, inspect
from ...view import Tensor, View
from ..catchup import decode_in_place
from ..ownership import Ownership
from ..staged import WriteMode
from ..vllm.layout import locate
from ..writing import release
from .owned import decode_owned, export_blocks, place_block, read_decoded_all, unmap_arena
from .ranked import RankWeights
from .staged import HeldWeights
from .wire import read_line

__all__ = ["rollpatch_weight_loader", "run_op"]


class _State:
    """This process's weights, control server and last command results."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.weights: HeldWeights | None = None
        self.server: socketserver.UnixStreamServer | None = None
        #: This process's identity: an SGLang restarted under its sidecar has a new one (the
        #: adapter compares it at each audit: its words are the boot checkpoint's); so does
        #: another adapter taking over (:mod:`..ownership`).
        self.boot = secrets.token_hex(8)
        #: The adapter driving this SGLang (:mod:`..ownership`: one sidecar per engine).
        self.owner = Ownership()


_STATE = _State()


def _build(model: Any) -> HeldWeights:
    from sglang.srt.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    from .buffers import TorchBuffers
    from .describe import describe, param_words

    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    specs, kinds, params = describe(model, tp)
    words = {n: param_words(p) for n, p in params.items()}
    # TP > 1: blocks of split tensors, sums per rank combined by the adapter
    cls = RankWeights if tp > 1 else HeldWeights
    return cls(words, specs, kinds, rank=rank, tp=tp, buffers=TorchBuffers(params))


def _weights() -> HeldWeights:
    if _STATE.weights is None:
        raise EngineError("the SGLang extension is not started", hint="the adapter starts it")
    return _STATE.weights


def _mode(r: dict[str, Any]) -> WriteMode:
    mode = r.get("mode", "in_place")
    if mode not in ("in_place", "double_buffer"):
        raise EngineError("unknown write mode", mode=str(mode)[:40])
    return "double_buffer" if mode == "double_buffer" else "in_place"


def _timed(w: HeldWeights, stage: Callable[[], dict[str, Any]], first: str) -> dict[str, Any]:
    """``stage()``'s summary with its phases (ms): ``first`` (what came before
    :meth:`HeldWeights.stage`: decoding or reading the patch) and the staging's own."""
    t0 = time.perf_counter()
    w.last_stage_ms = {}
    out = stage()
    own = dict(w.last_stage_ms)
    before = (time.perf_counter() - t0) * 1e3 - sum(own.values())
    return {**out, "phases": {first: round(before, 3), **{k: round(v, 3) for k, v in own.items()}}}


def _stage_encoded(w: HeldWeights, steps: list[dict[str, Any]], mode: WriteMode) -> dict[str, Any]:
    """Decode a chain of published steps (``steps[k]``: its ``paths``, the step's shards, and
    its ``base`` and ``target``) against the live words and prove it. One step: decoded as
    it is; several: every touched tensor decoded step after step in one private copy per
    thread (:func:`rollpatch.engines.catchup.decode_in_place`: the decoder's own rp.sum128
    changes prove each tensor's target), the composed change staged. Nothing of the model
    leaves SGLang's process."""
    if isinstance(w, RankWeights):
        raise EngineError(
            "at TP > 1 no rank holds every tensor whole to decode against",
            tp=w.tp,
            hint="the adapter stages decoded patches (stage_decoded)",
        )
    base, target = str(steps[0]["base"]), str(steps[-1]["target"])
    if w.root() != base:  # decoding against another base would read wrong contexts
        raise BaseMismatchError(
            "engine root digest is not the step's base",
            expected=base[:16],
            actual=w.root()[:16],
            hint="the engine is on another version; plan a new path",
        )
    blobs = [[Path(str(p)).read_bytes() for p in step["paths"]] for step in steps]
    if len(steps) > 1:
        return _timed(w, lambda: w.stage(_chain(w, steps, blobs), mode).summary(), "decode")
    tensors: dict[str, TensorPatch] = {}

    def decoded() -> Patch:
        for blob in blobs[0]:
            header = inspect(blob)  # the container and header, validated; no payload yet
            names = sorted(e["name"] for e in header.tensors if e["name"] in w)
            part = decode(blob, w.view(names), check_base=False)
            if set(part.tensors) & set(tensors):
                raise PatchError("two patch objects of one step touch the same tensor")
            tensors.update(part.tensors)
        return Patch(base, target, tensors, {})

    return _timed(w, lambda: w.stage(decoded(), mode).summary(), "decode")


def _chain(w: HeldWeights, steps: list[dict[str, Any]], blobs: list[list[bytes]]) -> Patch:
    """The chain decoded in place into one patch from the live words (its composed change)."""
    names = sorted({e["name"] for parts in blobs for b in parts for e in inspect(b).tensors})
    missing = [n for n in names if n not in w]
    if missing:
        raise BaseMismatchError("the engine lacks a tensor the patch changes", tensor=missing[0])
    spec = [{"base": str(s["base"]), "target": str(s["target"])} for s in steps]
    out = decode_in_place(w.view(names), spec, blobs, w.state_of)
    if out is None:
        raise PatchError(
            "a step of the chain is not in the in-place codec",
            hint="the adapter stages such chains through the follower (decoded outside)",
        )
    return out[0]


def _export(w: HeldWeights, name: str, path: str, into: bool) -> dict[str, Any]:
    """One tensor to ``path``: a safetensors file; at TP > 1 this rank's block, either as a
    file or (``into``) copied into its place in the whole tensor the adapter mapped there."""
    if isinstance(w, RankWeights):  # this rank's block, placed by the adapter
        if into:  # the adapter's shared buffer of the whole tensor (rows x cols words)
            where, nbytes = place_block(w, name, path)
            return {"bytes": nbytes, **where}
        block, pl = w.block(name)
        where = {"dim": pl.dim, "start": pl.src_start, "length": pl.length}
        flat = np.ascontiguousarray(block).reshape(-1)
        save_view(View({name: Tensor(w.kind_of(name), block.shape, flat)}), path)
        return {"bytes": flat.nbytes, **where}
    t = w[name]
    save_view(View({name: t}), path)
    return {"bytes": t.nbytes, "digest": w.digest_of(name)}


def _digest(w: HeldWeights, fresh: bool) -> dict[str, Any]:
    if isinstance(w, RankWeights):
        return {"blocks": w.blocks(fresh=fresh)}
    return {"digests": w.digests(fresh=fresh), "root": w.root()}


def _drop(w: HeldWeights) -> dict[str, Any]:
    n = len(w.staged)
    w.staged.clear()
    return {"dropped": n}


def _paths(w: HeldWeights, r: dict[str, Any]) -> list[str]:
    """A staging's decoded-patch files: ``paths`` (every rank reads them), or this rank's
    own (``by_rank``: the owners' parts holding the changes in its blocks)."""
    by_rank = r.get("by_rank")
    return list(by_rank[str(w.rank)] if isinstance(by_rank, dict) else r["paths"])


def _info(w: HeldWeights) -> dict[str, Any]:
    return {
        "rank": w.rank,
        "tp": w.tp,
        "pid": os.getpid(),
        "tensors": {n: [w.kind_of(n).name, list(w.shape_of(n))] for n in w.names()},
        "params": len(w.params),
    }


_CONTROL: dict[str, Callable[[HeldWeights, dict[str, Any]], dict[str, Any]]] = {
    "info": lambda w, r: _info(w),
    "digest": lambda w, r: _digest(w, bool(r.get("fresh"))),
    "stage_encoded": lambda w, r: _stage_encoded(w, list(r["steps"]), _mode(r)),
    "stage_decoded": lambda w, r: _timed(
        w, lambda: w.stage(read_decoded_all(_paths(w, r)), _mode(r)).summary(), "read"
    ),
    "export_blocks": lambda w, r: export_blocks(w, list(r["items"])),
    "decode_owned": lambda w, r: decode_owned(w, r),
    "unmap_arena": lambda w, r: unmap_arena(),
    "export": lambda w, r: _export(w, str(r["name"]), str(r["path"]), bool(r.get("into"))),
    "audit": lambda w, r: w.audit(int(r["budget"])),
    "drop": lambda w, r: _drop(w),
    "release": lambda w, r: w.release() if isinstance(w, RankWeights) else {"released": 0},
    "disown": lambda w, r: _STATE.owner.disown(),
}


def _control(op: str, req: dict[str, Any]) -> dict[str, Any]:
    if op == "claimable":  # another adapter asks before it touches SGLang's update routes
        return {"claimable": True, "takes_over": _STATE.owner.claimable(req.get("owner"))}
    _STATE.owner.check(req.get("owner"))
    return _CONTROL[op](_weights(), req)


def run_op(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one operation under the state lock; never raises (errors become ``ok: False``)."""
    t0 = time.perf_counter()
    try:
        with _STATE.lock:
            out = {"ok": True, **fn(), "boot": _STATE.boot}
    except Exception as err:  # noqa: BLE001 - reported to the adapter (errors.engine_error)
        out = {"ok": False, "error": error_report(err)}
    out["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    return out


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        try:
            req = json.loads(read_line(self.request))
            op = req.get("op") if isinstance(req, dict) else None
        except (RollpatchError, json.JSONDecodeError, OSError):
            return
        if op in _CONTROL or op == "claimable":
            out = run_op(functools.partial(_control, op, req))
        else:
            out = {
                "ok": False,
                "error": {"type": "EngineError", "message": f"unknown control operation {op!r}"},
            }
        self.request.sendall(json.dumps(out, separators=(",", ":")).encode() + b"\n")


def _start(model: Any, sock: str, owner: Any) -> dict[str, Any]:
    if _STATE.owner.claim(owner):  # what the adapter before verified is void
        _STATE.boot = secrets.token_hex(8)
    if _STATE.weights is None:
        _STATE.weights = _build(model)
    if _STATE.server is None or _STATE.server.server_address != sock:
        if _STATE.server is not None:
            _STATE.server.shutdown()
        Path(sock).unlink(missing_ok=True)
        server = socketserver.UnixStreamServer(sock, _Handler)
        os.chmod(sock, 0o600)
        threading.Thread(target=server.serve_forever, name="rollpatch-control", daemon=True).start()
        _STATE.server = server
    return {"socket": sock, "pid": os.getpid(), "boot": _STATE.boot}


def _flip(w: HeldWeights, name: str, position: int) -> dict[str, Any]:
    """Fault injection: flip the lowest bit of checkpoint element ``position`` of ``name``
    where this rank holds it, behind every digest (``flipped``: 0 where it holds none)."""
    if os.environ.get("ROLLPATCH_FAULT_INJECTION") != "1":
        raise EngineError(
            "fault injection is off",
            hint="start SGLang with ROLLPATCH_FAULT_INJECTION=1 (drills and tests only)",
        )
    pl = w.placement(name)
    if not 0 <= position < pl.n_elements:
        raise EngineError("position out of range", tensor=name, position=position)
    _, offsets = locate(pl, np.array([position], np.int64))
    w.params[pl.param].reshape(-1)[offsets] ^= 1
    return {"flipped": int(offsets.size)}


def _forget() -> dict[str, Any]:
    """Fault injection: this process as an SGLang restarted under its sidecar leaves it: no
    rollpatch state, no control thread, a new identity (the words stay)."""
    if os.environ.get("ROLLPATCH_FAULT_INJECTION") != "1":
        raise EngineError(
            "fault injection is off",
            hint="start SGLang with ROLLPATCH_FAULT_INJECTION=1 (drills and tests only)",
        )
    if _STATE.server is not None:
        _STATE.server.shutdown()
        _STATE.server.server_close()
        Path(str(_STATE.server.server_address)).unlink(missing_ok=True)
    _STATE.server, _STATE.weights, _STATE.boot = None, None, secrets.token_hex(8)
    _STATE.owner.disown()
    return {"forgot": True}


def _command(model: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    if op == "start":
        return _start(model, str(cmd["socket"]), cmd.get("owner"))
    _STATE.owner.check(cmd.get("owner"))
    w = _weights()
    if op == "commit":
        staged = w.commit(str(cmd["token"]))
        exchanged = len(staged.retired)  # counted before the release thread empties it
        if isinstance(w, RankWeights):  # kept for an undo until the adapter's release
            return {"target": staged.target, "changed": staged.changed, "exchanged": exchanged}
        retired, staged.retired = staged.retired, {}
        if retired:  # the storage a double-buffered commit replaced: freed after the pause
            threading.Thread(
                target=release, args=(retired,), name="rollpatch-release", daemon=True
            ).start()
        return {
            "target": staged.target,
            "changed": staged.changed,
            "root": None if isinstance(w, RankWeights) else w.root(),
            "exchanged": exchanged,
        }
    if op == "noop":  # a rank with nothing to do in a per-rank command
        return {}
    if op == "undo" and isinstance(w, RankWeights):
        return w.undo(str(cmd["token"]))
    if op == "flip":
        return _flip(w, str(cmd["name"]), int(cmd["position"]))
    if op == "forget":
        return _forget()
    if op == "load":
        root = w.load(load_view(str(cmd["path"]), mmap=True))
        if isinstance(w, RankWeights):
            return {"root": None, "blocks": w.blocks()}
        return {"root": root}
    raise EngineError(f"unknown rollpatch command {op!r}")


def rollpatch_weight_loader(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry point: run each command (the names) and write its result
    to the command's ``reply`` file (atomically: written aside, then renamed)."""
    for name, _ in named_tensors:
        try:
            cmd = json.loads(name)
            reply = Path(str(cmd["reply"]))
        except (json.JSONDecodeError, TypeError, KeyError):
            continue  # not ours: nothing to answer to
        out = run_op(functools.partial(_command, model, cmd))
        with contextlib.suppress(OSError):
            tmp = reply.with_name(reply.name + ".tmp")
            tmp.write_text(json.dumps(out, separators=(",", ":")))
            tmp.replace(reply)
