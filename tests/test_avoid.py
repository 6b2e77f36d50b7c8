"""Corrupt objects remembered by :mod:`rollpatch.avoid`: planned around, and re-checked on a
backoff when nothing else is left (never downloaded again on every sync)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from rollpatch import avoid
from rollpatch.avoid import BadObjects, plan_around
from rollpatch.errors import NoPathError, ObjectIntegrityError

LOG = logging.getLogger("test.avoid")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(avoid, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_due_at_once_then_on_a_doubling_backoff_capped(clock: list[float]) -> None:
    bad = BadObjects(recheck_s=4.0)
    assert bad.add("k") is True
    assert bad.due(frozenset({"k"})) == {"k"}  # the first re-check is due at once
    assert bad.due(frozenset({"k"})) == set()
    seen = []
    for _ in range(48):  # 0.25 s ticks for 12 s
        clock[0] += 0.25
        if bad.due(frozenset({"k"})):
            seen.append(clock[0] - 1000.0)
    assert seen == [1.0, 3.0, 7.0, 11.0]  # 1, 2, then 4 s (the cap) apart


def test_finding_it_corrupt_again_does_not_restart_the_backoff(clock: list[float]) -> None:
    bad = BadObjects(recheck_s=60.0)
    bad.add("k")
    assert bad.due(frozenset({"k"}))
    assert bad.add("k") is False  # the re-check found it still corrupt
    assert not bad.due(frozenset({"k"}))
    clock[0] += 1.0
    assert bad.due(frozenset({"k"}))


def test_entries_expire_and_memory_is_bounded(clock: list[float]) -> None:
    bad = BadObjects(ttl_s=10.0, max_keys=2)
    for k in ("a", "b", "c"):
        bad.add(k)
        clock[0] += 1.0
    assert bad.keys() == {"b", "c"}
    clock[0] += 10.0
    assert bad.keys() == set()
    with pytest.raises(ValueError):
        BadObjects(ttl_s=0)


class Board:
    """A board with one path, through object ``k``, corrupt until ``repaired``."""

    def __init__(self) -> None:
        self.repaired = False
        self.downloads = 0

    def run_plan(self, avoid_keys: frozenset[str]) -> str:
        if "k" in avoid_keys:
            raise NoPathError("no chain of patches or keyframe reaches the version")
        self.downloads += 1
        if not self.repaired:
            raise ObjectIntegrityError("object does not match its manifest entry", key="k")
        return "synced"


def test_no_download_of_a_known_corrupt_object_until_its_recheck(clock: list[float]) -> None:
    bad, board = BadObjects(), Board()
    for expected in (1, 2, 2, 2):  # meet, re-check at once, then nothing for a second
        with pytest.raises(ObjectIntegrityError) as e:
            plan_around(bad, "r", board.run_plan, log=LOG)
        assert board.downloads == expected
    assert e.value.context["avoiding"] == ["k"]
    board.repaired = True
    with pytest.raises(ObjectIntegrityError):  # repaired, but not yet due
        plan_around(bad, "r", board.run_plan, log=LOG)
    clock[0] += 1.0
    assert plan_around(bad, "r", board.run_plan, log=LOG) == "synced"
    assert board.downloads == 3


def test_a_repaired_object_is_used_at_the_next_sync(clock: list[float]) -> None:
    """The first re-check is due at once: an operator's repair is picked up by the very next
    sync (tests/test_follower_healing.py relies on it)."""
    bad, board = BadObjects(), Board()
    with pytest.raises(ObjectIntegrityError):
        plan_around(bad, "r", board.run_plan, log=LOG)
    board.repaired = True
    assert plan_around(bad, "r", board.run_plan, log=LOG) == "synced"


def test_no_path_without_remembered_objects_is_the_no_path_error(clock: list[float]) -> None:
    def nowhere(_: frozenset[str]) -> str:
        raise NoPathError("no chain")

    with pytest.raises(NoPathError):
        plan_around(BadObjects(), "r", nowhere, log=LOG)
