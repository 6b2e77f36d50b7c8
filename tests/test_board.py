"""The board: manifests, the monotonic pointer, planning, retention."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from rollpatch.board import Board, keyframe_marker_key, pointer_key, version_key
from rollpatch.errors import (
    AlreadyExistsError,
    ConfigError,
    ManifestError,
    NoPathError,
    VersionNotFoundError,
)
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.planning import cheapest_plan
from rollpatch.types import Constraint, ObjectRef, satisfies
from tests.conftest import DIGEST as D
from tests.conftest import make_manifest


def _publish(
    board: Board,
    run: str,
    n: int,
    *,
    keyframe: bool = False,
    skips: tuple[int, ...] = (),
    size: int = 60,
    kf_size: int = 1400,
) -> None:
    pats = []
    if n > 0:
        ref = board.put_object(run, f"patch {n} ".encode() * (size // 8), "rpatch")
        pats.append(PatchObject(ref, n - 1, D))
    for s in skips:
        ref = board.put_object(run, f"skip {n}-{s}".encode() * 2, "rpatch")
        pats.append(PatchObject(ref, n - s, D))
    kfs = (
        (KeyframeObject(board.put_object(run, f"kf {n}".encode() * (kf_size // 5), "safetensors")),)
        if keyframe
        else ()
    )
    board.put_manifest(
        make_manifest(run, n, view_bytes=kf_size, patches=tuple(pats), keyframes=kfs)
    )
    board.advance(run, n)


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


def test_layout_and_listing(board: Board) -> None:
    for n in range(6):
        _publish(board, "r1", n, keyframe=n in (0, 4))
    assert board.runs() == ["r1"]
    assert board.versions("r1") == list(range(6))
    assert board.keyframes("r1") == [0, 4]
    latest = board.latest("r1")
    assert latest is not None and latest.version == 5 and latest.target == D


def test_pointer_never_moves_backwards(board: Board) -> None:
    for n in range(4):
        _publish(board, "r1", n, keyframe=n == 0)
    assert board.advance("r1", 1).version == 3
    assert board.latest("r1").version == 3  # type: ignore[union-attr]


def test_racing_advances_keep_the_maximum(board: Board) -> None:
    _publish(board, "r2", 0, keyframe=True)
    for n in range(1, 30):
        ref = board.put_object("r2", f"p{n}".encode(), "rpatch")
        board.put_manifest(
            make_manifest(
                "r2", n, created=0.0, publisher="t", patches=(PatchObject(ref, n - 1, D),)
            )
        )
    threads = [threading.Thread(target=board.advance, args=("r2", n)) for n in range(1, 30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert board.latest("r2").version == 29  # type: ignore[union-attr]


def test_manifest_immutable_and_objects_first(board: Board) -> None:
    _publish(board, "r1", 0, keyframe=True)
    ref = board.put_object("r1", b"x", "rpatch")
    other = make_manifest(
        "r1", 0, target="b" * 64, created=0.0, publisher="t", keyframes=(KeyframeObject(ref),)
    )
    with pytest.raises(AlreadyExistsError):
        board.put_manifest(other)
    ghost = make_manifest(
        "r1",
        1,
        created=0.0,
        publisher="t",
        patches=(PatchObject(ref.__class__("runs/r1/objects/missing.rpatch", 3, "c" * 64), 0, D),),
    )
    with pytest.raises(ManifestError, match="not durable"):
        board.put_manifest(ghost)
    with pytest.raises(VersionNotFoundError):
        board.advance("r1", 1)


def test_plan_fewest_bytes(board: Board) -> None:
    for n in range(17):
        _publish(board, "r1", n, keyframe=n in (0, 16), skips=(8,) if n % 8 == 0 and n else ())
    p = board.plan("r1", 8, 9)
    assert [(s.base, s.to) for s in p.steps] == [(8, 9)]
    p = board.plan("r1", 0, 8)
    assert [(s.base, s.to) for s in p.steps] == [(0, 8)]  # the skip patch
    p = board.plan("r1", None, 16)
    assert [(s.base, s.to) for s in p.steps] == [(None, 16)]  # the keyframe of 16
    p = board.plan("r1", None, 15)
    assert p.steps[0].is_keyframe and p.steps[0].to == 0
    assert board.plan("r1", 3, 3).steps == ()
    with pytest.raises(NoPathError):
        board.plan("r1", 5, 4)


def test_plan_prefers_keyframe_when_chain_is_bigger(board: Board) -> None:
    for n in range(6):
        _publish(board, "r1", n, keyframe=n in (0, 5), size=4000, kf_size=1000)
    p = board.plan("r1", 1, 5)
    assert [(s.base, s.to) for s in p.steps] == [(None, 5)]


def test_fetch_verifies_hash(board: Board) -> None:
    _publish(board, "r1", 0, keyframe=True)
    ref = board.manifest("r1", 0).keyframes[0].ref
    board.store.put(ref.key, b"tampered", if_absent=False)
    with pytest.raises(ManifestError, match="corrupt"):
        board.fetch(ref)


def test_malformed_manifests_refused(board: Board) -> None:
    _publish(board, "r1", 0, keyframe=True)
    for raw in [b"{", b"[]", b'{"schema": "rollpatch.manifest/1"}', b"x" * 100]:
        board.store.put(version_key("r1", 7), raw, if_absent=False)
        board._cache.clear()
        with pytest.raises(ManifestError):
            board.manifest("r1", 7)


def test_signed_manifest() -> None:
    from rollpatch.errors import TrustError
    from rollpatch.manifest import open_manifest
    from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

    key, other = SigningKey.generate(), SigningKey.generate()
    m = make_manifest(
        "r1", 0, created=0.0, publisher="t", keyframes=(KeyframeObject(ObjectRef("k", 1, D)),)
    )
    raw = m.stored_bytes(Signer(keys=(key,)))
    assert open_manifest(raw, "r1", 0, Trust(sign_root(Root.new([key.public]), [key]))) == m
    with pytest.raises(TrustError, match="bad_signature"):
        open_manifest(raw, "r1", 0, Trust(sign_root(Root.new([other.public]), [other])))
    assert open_manifest(raw, "r1", 0, None) == m  # no trust root: read, not verified
    # a manifest from before signed envelopes (an HMAC "signature" field) still reads
    old = m.to_json() | {"signature": "ab" * 32}
    assert Manifest.from_json(old) == m


def test_bad_run_names() -> None:
    b = Board("memory://names")
    for run in ["", "../x", "a/b", "x" * 200]:
        with pytest.raises(ConfigError):
            b.latest(run)


def test_constraints() -> None:
    assert satisfies(5, Constraint(min_version=5), latest=9)
    assert not satisfies(4, Constraint(min_version=5), latest=9)
    assert satisfies(7, Constraint(max_lag=2), latest=9)
    assert not satisfies(6, Constraint(max_lag=2), latest=9)
    assert not satisfies(6, Constraint(exact_version=7), latest=9)
    with pytest.raises(ConfigError):
        Constraint(min_version=-1)
    with pytest.raises(ConfigError):
        Constraint(exact_version=1, min_version=3)


def test_gc_keeps_every_plan_working(board: Board) -> None:
    from rollpatch.retention import collect

    for n in range(30):
        _publish(board, "r1", n, keyframe=n % 10 == 0, skips=(8,) if n % 8 == 0 and n else ())
    orphan = board.put_object("r1", b"crashed publisher leftovers", "rpatch")
    report = collect(board, "r1", keep_last=5, orphan_grace_s=3600)
    assert report.cutoff == 20 and report.versions_deleted == list(range(20))
    assert orphan.key not in report.orphans_deleted  # too young: maybe an in-flight publish
    board._cache.clear()
    assert board.versions("r1") == list(range(20, 30))
    for have in [None, *range(20, 30)]:
        plan = board.plan("r1", have, 29)
        for step in plan.steps:
            for ref in step.objects:
                board.fetch(ref)
    report = collect(board, "r1", keep_last=5, orphan_grace_s=60, now=time.time() + 120)
    assert orphan.key in report.orphans_deleted and report.versions_deleted == []
    assert board.store.head(orphan.key) is None


def test_gc_dry_run_and_pins(board: Board) -> None:
    from rollpatch.retention import collect

    for n in range(12):
        _publish(board, "r1", n, keyframe=n in (0, 10))
    report = collect(board, "r1", keep_last=1, pinned=[4], dry_run=True)
    assert report.cutoff == 0 and report.versions_deleted == []
    report = collect(board, "r1", keep_last=1, dry_run=True)
    assert report.cutoff == 10 and report.versions_deleted == list(range(10))
    assert board.versions("r1") == list(range(12))


def test_gc_reports_an_unreadable_manifest_and_keeps_its_objects(any_board: Board) -> None:
    """A corrupt manifest below the cutoff is deleted and reported with its reason; the
    objects it may name are not guessed at: the orphan rule takes them once past the grace."""
    from rollpatch.retention import collect

    board = any_board
    for n in range(12):
        _publish(board, "r1", n, keyframe=n in (0, 10))
    lost = board.manifest("r1", 3).patches[0].ref.key
    board.store.put(version_key("r1", 3), b"{not json", if_absent=False)
    board._cache.clear()
    report = collect(board, "r1", keep_last=1)
    assert report.cutoff == 10 and report.versions_deleted == list(range(10))
    assert [v for v, _ in report.unreadable] == [3] and "manifest" in report.unreadable[0][1]
    assert lost not in report.objects_deleted and board.store.head(lost) is not None
    assert len(set(report.objects_deleted)) == len(report.objects_deleted)
    assert board.versions("r1") == [10, 11] and board.keyframes("r1") == [10]
    later = collect(board, "r1", keep_last=1, orphan_grace_s=60, now=time.time() + 7200)
    assert later.orphans_deleted == [lost] and later.unreadable == []
    assert board.store.head(lost) is None
    for have in (None, 10):
        assert board.plan("r1", have, 11).steps


def test_gc_cli(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from rollpatch.cli import main

    b = Board(f"file://{tmp_path}")
    for n in range(12):
        _publish(b, "r1", n, keyframe=n in (0, 10))
    assert (
        main(
            ["gc", "--board", f"file://{tmp_path}", "--run", "r1", "--keep-last", "1", "--dry-run"]
        )
        == 0
    )
    assert "would delete 10 versions" in capsys.readouterr().out
    assert b.versions("r1") == list(range(12))
    assert main(["gc", "--board", f"file://{tmp_path}", "--run", "r1", "--keep-last", "1"]) == 0
    assert b.versions("r1") == [10, 11]


# -- bounded planning and strict LATEST (issue 11) ----------------------------------------------


class _CountingGets:
    """Counts the store reads a call makes (wraps the board's store in place)."""

    def __init__(self, board: Board) -> None:
        self.gets = 0
        inner = board.store.get

        def get(key: str, **bounds: int) -> bytes:
            self.gets += 1
            return inner(key, **bounds)

        board.store.get = get  # type: ignore[method-assign]


def _pointer(run: str, version: object, **over: object) -> bytes:
    doc = {
        "run": run,
        "version": version,
        "manifest": version_key(run, version)  # type: ignore[arg-type]
        if isinstance(version, int)
        else "x",
        "target": D,
        **over,
    }
    return json.dumps(doc).encode()


def test_plan_to_a_huge_latest_reads_nothing_it_does_not_list(board: Board) -> None:
    for n in range(4):
        _publish(board, "r1", n, keyframe=n == 0)
    board.store.put(pointer_key("r1"), _pointer("r1", 10**12), if_absent=False)
    assert board.latest("r1").version == 10**12  # type: ignore[union-attr]
    counter = _CountingGets(board)
    with pytest.raises(VersionNotFoundError):
        board.plan("r1", None, 10**12)
    with pytest.raises(VersionNotFoundError):
        board.plan("r1", 2, 10**12)
    # refused from one listing and one read of the version itself by key (a listing may lag
    # the LATEST that named it: session 42), no walk over the versions between
    assert counter.gets == 2
    with pytest.raises(ConfigError):
        board.plan("r1", None, 2**60)
    assert board.plan("r1", None, 3).want == 3


def test_plan_reads_at_most_max_plan_versions(board: Board) -> None:
    for n in range(8):
        _publish(board, "r1", n, keyframe=n == 0)
    small = Board(board.store, max_plan_versions=3)
    counter = _CountingGets(small)
    with pytest.raises(NoPathError):  # the only keyframe is outside the window of 3
        small.plan("r1", None, 7)
    assert counter.gets <= 3
    plan = small.plan("r1", 5, 7)
    assert [s.to for s in plan.steps] == [6, 7]
    with pytest.raises(ConfigError, match="max_plan_versions"):
        Board(board.store, max_plan_versions=0)


_BAD_LATEST = [
    b'{"run": "r1", "version": 1e400, "manifest": "x", "target": "' + b"a" * 64 + b'"}',
    b'{"run": "r1", "version": NaN}',
    b'{"run": "r1", "version": "3"}',
    b'{"run": "r1", "version": true}',
    b'{"run": "r1", "version": -1}',
    b'{"run": "r1", "version": 9007199254740992}',
    b'{"run": "r1", "version": 3.0}',
    b'{"run": "r1", "version": {"n": 3}}',
    b'{"run": {"r1": 1}, "version": 3}',
    b'{"run": "r1", "version": [' * 5000 + b"]" * 5000 + b"}",
    b"[" * 100_000,
    b'"\\ud800"',
    b"\xff",
    b'{"run": "r1", "version": 3, "manifest": "runs/r1/versions/000000000002.json"}',
    (
        b'{"run": "r1", "version": 3, "manifest": "runs/r1/versions/000000000003.json", '
        b'"target": {"a": 1}}'
    ),
    b" " * (1 << 20),
]


@pytest.mark.parametrize("raw", _BAD_LATEST, ids=[f"bad{i}" for i in range(len(_BAD_LATEST))])
def test_bad_latest_is_refused_clearly_and_repair_is_honoured(board: Board, raw: bytes) -> None:
    for n in range(4):
        _publish(board, "r1", n, keyframe=n == 0)
    board.store.put(pointer_key("r1"), raw, if_absent=False)
    with pytest.raises(ManifestError, match="LATEST"):
        board.latest("r1")
    board.store.put(pointer_key("r1"), _pointer("r1", 3), if_absent=False)
    assert board.latest("r1").version == 3  # type: ignore[union-attr]


def test_listing_ignores_keys_that_are_not_version_numbers(board: Board) -> None:
    _publish(board, "r1", 0, keyframe=True)
    for odd in (
        "versions/²³.json",
        "versions/12.txt",
        "versions/-1.json",
        "keyframes/x",
        "keyframes/٣",
    ):
        board.store.put(f"runs/r1/{odd}", b"")
    assert board.versions("r1") == [0] and board.keyframes("r1") == [0]


@pytest.mark.parametrize("kf_size", [1400, 20], ids=["patch", "keyframe-cheaper"])
def test_one_behind_plans_from_the_manifest_alone(board: Board, kf_size: int) -> None:
    """One version behind, the manifest of ``want`` (its parent is ``have``) is all a plan
    needs: no listing, at most one read, and the same plan full planning chooses (the keyframe when
    it is the cheaper way in, the patch on a tie)."""
    for n in range(5):
        _publish(board, "r1", n, keyframe=n in (0, 4), kf_size=kf_size if n == 4 else 1400)
    listed: list[str] = []
    inner_list = board.store.list

    def counting_list(prefix: str) -> list[str]:
        listed.append(prefix)
        return inner_list(prefix)

    board.store.list = counting_list  # type: ignore[method-assign]
    counter = _CountingGets(board)
    fast = board.plan("r1", 3, 4)
    assert listed == [] and counter.gets <= 1  # that manifest (unless the board holds it)
    full = cheapest_plan("r1", 3, 4, {v: board.manifest("r1", v) for v in range(5)})
    assert fast == full
    assert fast.steps[0].is_keyframe == (kf_size == 20)
    bad = frozenset(o.key for o in fast.steps[0].objects)  # that way is corrupt: the other
    other = board.plan("r1", 3, 4, avoid=bad)
    assert other.steps and other.steps[0].is_keyframe != fast.steps[0].is_keyframe
    assert board.plan("r1", 2, 4).steps and listed  # two behind: planned from the listing


def test_a_keyframe_marker_of_a_version_with_no_keyframe_is_passed_over(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """Audit I, H3 (session 42): markers are unsigned hints; an empty object at
    ``keyframes/{n}`` of a version with no keyframe (or no manifest) made every plan from
    nothing fail with NoPathError until the next real keyframe. Now the newest *real*
    keyframe is used, and the bogus markers are logged."""
    for n in range(6):
        _publish(board, "r1", n, keyframe=n == 0)
    board.store.put(keyframe_marker_key("r1", 4), b"")
    board.store.put(keyframe_marker_key("r1", 5000), b"")  # past the run: never read
    with caplog.at_level(logging.WARNING, logger="rollpatch.board"):
        plan = Board(board.store).plan("r1", None, 5)
    assert [s.base for s in plan.steps] == [None, 0, 1, 2, 3, 4] and plan.steps[0].to == 0
    assert any("are ignored: 4" in r.getMessage() for r in caplog.records)
    board.store.put(keyframe_marker_key("r1", 3), b"")
    board.store.put(keyframe_marker_key("r1", 1), b"")
    assert Board(board.store).plan("r1", None, 5).steps[0].to == 0
