"""The gateway's routing, tested pure (island specs, tiers, ranking, choosing without
repeats) and against a hostile island whose answers must not kill the poller. End to end
through the real openai client: test_gateway.py."""

from __future__ import annotations

import threading

import pytest

from rollpatch.errors import ConfigError
from rollpatch.gateway import (
    Gateway,
    GatewayConfig,
    IslandSpec,
    IslandView,
    Tier,
    parse_island,
    rank,
    tier_of,
)
from rollpatch.types import Constraint
from tests.conftest import until

FAST = GatewayConfig(poll_s=0.05, retry_backoff_s=0.05)


def test_a_hostile_island_answer_does_not_kill_the_poller() -> None:
    import http.server

    answers = [b"[" * 100_000, b'{"served": NaN}', b'{"served": 3, "latest": 3, "run": "r1"}']
    state = {"answer": answers[0]}

    class Island(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = state["answer"]
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Island)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gw = Gateway([f"evil=http://127.0.0.1:{server.server_address[1]}"], FAST)
    gw.start()
    try:
        for answer, why in zip(answers[:2], ("nested", "NaN")):
            state["answer"] = answer
            until(lambda why=why: why in str(gw.describe()[0]["last_error"]), "a refusal")
        state["answer"] = answers[2]
        until(lambda: gw.views()[0].served == 3, "the poller to survive and read a good answer")
    finally:
        gw.stop()
        server.shutdown()


# ---- pure parts -------------------------------------------------------------------------------


def test_parse_island() -> None:
    assert parse_island("east=http://10.0.0.5:8100/") == IslandSpec("east", "http://10.0.0.5:8100")
    assert parse_island("http://h:81").name == "h:81"
    with pytest.raises(ConfigError):
        parse_island("nope")
    with pytest.raises(ConfigError):
        Gateway(["http://h:1", "http://h:1"])
    with pytest.raises(ConfigError, match="max_attempts"):
        GatewayConfig(max_attempts=0)


def _view(
    name: str,
    served: int | None,
    inflight: int = 0,
    reachable: bool | None = True,
    latest: int | None = 10,
) -> IslandView:
    return IslandView(
        name,
        f"http://{name}:1",
        served=served,
        latest=latest,
        reachable=reachable,
        inflight=inflight,
    )


def test_tiers() -> None:
    c = Constraint(min_version=10)
    assert tier_of(_view("a", 10), c, 10) == Tier.READY
    assert tier_of(_view("a", 8), c, 10) == Tier.CATCH_UP
    assert tier_of(_view("a", 10), Constraint(min_version=11), 10) == Tier.FUTURE
    assert tier_of(_view("a", None), c, 10) == Tier.UNKNOWN
    assert tier_of(_view("a", 10, reachable=None), c, 10) == Tier.UNKNOWN
    assert tier_of(_view("a", 10, reachable=False), c, 10) == Tier.DOWN
    assert tier_of(_view("a", 10), Constraint(exact_version=9), 10) == Tier.HOPELESS
    assert tier_of(_view("a", 9), Constraint(exact_version=9), 10) == Tier.READY


def test_rank_prefers_ready_then_load_then_freshness() -> None:
    views = [
        _view("old", 8),
        _view("busy", 10, inflight=3),
        _view("idle", 10, inflight=1),
        _view("older", 7),
        _view("down", 10, reachable=False),
    ]
    order = [v.name for v, _ in rank(views, Constraint(min_version=10), 10)]
    assert order == ["idle", "busy", "old", "older", "down"]
    order = [v.name for v, _ in rank(views, Constraint(), 10)]
    assert order == ["old", "older", "idle", "busy", "down"]  # fewest in flight, then freshest
    ties = [_view("x", 10), _view("y", 10)]
    firsts = {rank(ties, Constraint(), 10, rotate=r)[0][0].name for r in range(2)}
    assert firsts == {"x", "y"}


def test_choose_never_repeats_and_stops_after_conflict() -> None:
    gw = Gateway(["a=http://a:1", "b=http://b:1", "c=http://c:1"])
    for name, served in (("a", 10), ("b", 9), ("c", 10)):
        gw.observe_version(name, {"served": served, "latest": 10, "state": "IDLE"})
    exact9 = Constraint(exact_version=9)
    assert gw.choose(exact9, [], None).name == "b"  # type: ignore[union-attr]
    assert gw.choose(exact9, ["b"], 409) is None  # a and c can never serve 9
    assert gw.choose(exact9, ["b"], 503) is None  # ... nor after a failure
    first = gw.choose(Constraint(), [], None)
    assert first is not None and first.name == "a"
    assert gw.choose(Constraint(), ["a"], 0).name == "c"  # type: ignore[union-attr]
    solo = Gateway(["http://s:1"])
    solo.observe_version("s:1", {"served": 3, "latest": 3})
    assert solo.choose(Constraint(), ["s:1"], 503) is not None  # the only island: again
    assert solo.choose(Constraint(), ["s:1"], 409) is None


def test_a_served_version_goes_back_only_after_a_failure_or_another_run() -> None:
    """Answers may arrive out of order, so a lower served version from an island that keeps
    answering is not believed; but an island that was unreachable, or now answers for another
    run, may really serve less (before session 38 the gateway kept its old number for good:
    monitoring said lag 0 for an island serving 5 while it showed 10)."""
    gw = Gateway(["a=http://a:1"])

    def served() -> int | None:
        return next(v.served for v in gw.views() if v.name == "a")

    gw.observe_version("a", {"served": 10, "latest": 10, "run": "r1"})
    gw.observe_version("a", {"served": 9, "latest": 10, "run": "r1"})  # an older answer
    assert served() == 10
    gw.observe_failure("a", "connection refused")  # restarted ...
    assert served() is None
    gw.observe_version("a", {"served": 5, "latest": 5, "run": "r1"})  # ... on an older version
    assert served() == 5
    gw.observe_version("a", {"served": 12, "latest": 12, "run": "r1"})
    gw.observe_version("a", {"served": 2, "latest": 2, "run": "r3"})  # another run
    assert served() == 2
    assert gw.describe()[0]["served"] == 2
