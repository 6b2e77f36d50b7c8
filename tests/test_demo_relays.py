"""Every refusal of an upstream answer by a relay names its cause: the relay logs it (reason,
key) as it counts it, and the demo's report breaks a relay's refusals down by reason.

(A full MoE demo once reported one refusal by relay "us" with no reason anywhere: the
``known_corrupt`` and ``too_large`` refusals were counted but never logged.)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from rollpatch.board import version_key
from rollpatch.demo.config import DemoConfig
from rollpatch.demo.monitor import Monitor
from rollpatch.demo.report import check_invariants
from rollpatch.errors import ManifestError, ObjectIntegrityError, StoreError
from rollpatch.relay import Relay, RelayConfig
from rollpatch.store import MemoryStore

KEY = "runs/r/objects/" + "b" * 64 + ".rpatch"  # its bytes do not hash to its name


def _refusals(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        dict(getattr(r, "rp_fields", {}))
        for r in caplog.records
        if getattr(r, "rp_event", None) == "refused"
    ]


def test_every_refusal_is_logged_with_its_reason_and_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    MemoryStore.reset("refusals")
    upstream = MemoryStore("refusals")
    upstream.put(KEY, b"not what the name says")
    upstream.put(version_key("r", 3), b'{"schema": "nope"}')
    upstream.put("runs/r/notes.txt", b"x" * 100)  # volatile, over the limit below
    config = RelayConfig(cache_dir=tmp_path, max_volatile_bytes=10)
    relay = Relay(upstream, config)
    caplog.set_level(logging.WARNING, logger="rollpatch")
    try:
        for key, error in (
            (KEY, ObjectIntegrityError),  # hash_mismatch
            (KEY, ObjectIntegrityError),  # known_corrupt: same ETag upstream, no GET
            (version_key("r", 3), ManifestError),  # invalid_manifest
            ("runs/r/notes.txt", StoreError),  # too_large
        ):
            with pytest.raises(error):
                relay.resolve(key).result(timeout=30)
        counted = {
            reason: relay.metrics.value("rollpatch_relay_refused_total", reason=reason)
            for reason in ("hash_mismatch", "known_corrupt", "invalid_manifest", "too_large")
        }
    finally:
        relay.close()
    assert counted == {
        "hash_mismatch": 1,
        "known_corrupt": 1,
        "invalid_manifest": 1,
        "too_large": 1,
    }
    logged = _refusals(caplog)
    assert [(f["reason"], f["key"]) for f in logged] == [
        ("hash_mismatch", KEY),
        ("known_corrupt", KEY),
        ("invalid_manifest", version_key("r", 3)),
        ("too_large", "runs/r/notes.txt"),
    ]
    assert logged[2]["error"] and logged[3]["size"] == 100


class _Metrics:
    """What a relay's ``/metrics`` answers, for the demo's monitor poll."""

    text = (
        "# TYPE rollpatch_relay_refused_total counter\n"
        'rollpatch_relay_refused_total{reason="known_corrupt"} 2\n'
        'rollpatch_relay_refused_total{reason="hash_mismatch"} 1\n'
        "rollpatch_relay_upstream_bytes_total 1234\n"
    )

    def get(self, url: str) -> _Metrics:
        if not url.endswith("/metrics"):
            raise OSError("not polled here")
        return self


def test_the_demo_report_names_each_refusal_by_reason(tmp_path: Path) -> None:
    m = Monitor(DemoConfig(out=str(tmp_path)), (tmp_path / "board").as_uri(), [])
    m.relay("us").url = "http://relay-us"
    m.poll(_Metrics())
    us = m.relays["us"]
    assert (us.refused, us.refused_by, us.upstream_bytes) == (
        3,
        {"known_corrupt": 2, "hash_mismatch": 1},
        1234,
    )
    verdict = check_invariants(m)["fetched_bytes_verified"]
    assert verdict["ok"] is False
    assert (
        "relays refused 3 upstream answers (us: hash_mismatch 1, known_corrupt 2"
        in (verdict["detail"])
    )
