"""The typed vocabulary: tensor ops, protocol decisions and manifests are closed, typed sets.

mypy (``strict_equality``) rejects a misspelt op or action where it is built or compared;
these tests pin the runtime side: each op's payload is reached through a typed accessor that
refuses the wrong op, every decision the protocol makes is one of its declared actions, and
a manifest cannot be built by position.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest

from rollpatch.errors import PatchError
from rollpatch.kinds import KINDS
from rollpatch.manifest import KeyframeObject, Manifest
from rollpatch.patch.model import OPS, TensorOp, TensorPatch
from rollpatch.protocol import ACTIONS, Action, Decision, decide
from rollpatch.types import Constraint, ObjectRef
from rollpatch.view import Tensor
from tests.conftest import DIGEST, make_manifest

BF16 = KINDS["bf16"]


def test_ops_are_the_literal_and_the_runtime_check() -> None:
    assert typing.get_args(TensorOp) == OPS == ("delta", "full", "drop")
    with pytest.raises(PatchError, match="unknown tensor op"):
        TensorPatch("t", "dleta", BF16, (2,), None, None)  # type: ignore[arg-type]


def test_each_op_payload_comes_from_its_accessor_only() -> None:
    pos, old, new = np.array([1], np.int64), np.array([3], np.uint16), np.array([4], np.uint16)
    delta = TensorPatch("t", "delta", BF16, (2,), DIGEST, DIGEST, pos, old, new)
    ch = delta.changes()
    assert ch.positions is pos and ch.old is old and ch.new is new
    with pytest.raises(PatchError, match="carries no tensor"):
        delta.full_tensor()
    t = Tensor(BF16, (2,), np.zeros(2, np.uint16))
    full = TensorPatch("t", "full", BF16, (2,), None, DIGEST, tensor=t)
    assert full.full_tensor() is t and full.n_changed == 2
    with pytest.raises(PatchError, match="no changed positions"):
        full.changes()
    drop = TensorPatch("t", "drop", BF16, (2,), DIGEST, None)
    for accessor in (drop.changes, drop.full_tensor):
        with pytest.raises(PatchError):
            accessor()


@pytest.mark.parametrize("served", [None, 0, 3, 5, 9])
@pytest.mark.parametrize("latest", [None, 5, 9])
@pytest.mark.parametrize(
    "c",
    [
        Constraint(),
        Constraint(min_version=5),
        Constraint(exact_version=5),
        Constraint(max_lag=1),
        Constraint(min_version=7),
    ],
)
def test_every_decision_is_a_declared_action(
    c: Constraint, served: int | None, latest: int | None
) -> None:
    d = decide(c, served, latest)
    assert isinstance(d, Decision) and d.action in ACTIONS
    assert typing.get_args(Action) == ACTIONS


def test_manifest_is_keyword_only() -> None:
    kf = (KeyframeObject(ObjectRef("runs/r1/objects/k", 1, DIGEST)),)
    with pytest.raises(TypeError):
        Manifest("r1", 0, None, "bf16", DIGEST, 1, 0.0, "t", (), kf)  # type: ignore[call-arg]
    m = make_manifest("r1", 0, keyframes=kf, created=0.0)
    assert Manifest.from_json(m.to_json()) == m
