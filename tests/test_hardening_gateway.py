"""Issue 11: the gateway must not follow one island's inflated LATEST.

An island whose board was tampered with (LATEST = 10^12, no such version), or a hostile
island, reports a huge LATEST on ``/version``. Taking the maximum over islands made every
``max_lag`` request chase a version that does not exist, and kept that maximum after repair.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rollpatch.gateway import Gateway, GatewayConfig, IslandView, Tier, fleet_latest, tier_of
from rollpatch.types import Constraint

HUGE = 10**12


def _view(
    name: str, served: int | None, latest: int | None, reachable: bool | None = True
) -> IslandView:
    return IslandView(name, f"http://{name}:1", served=served, latest=latest, reachable=reachable)


def test_fleet_latest_is_the_lower_median_of_reachable_islands() -> None:
    assert fleet_latest([]) is None
    assert fleet_latest([_view("a", 5, HUGE)]) == HUGE  # alone, an island is the fleet
    assert fleet_latest([_view("a", 5, 5), _view("liar", 5, HUGE)]) == 5
    assert fleet_latest([_view("a", 5, 6), _view("b", 4, 5), _view("liar", 5, HUGE)]) == 6
    # an island that serves a newer version than its LATEST vouches for that version
    assert fleet_latest([_view("a", 7, 5), _view("b", 7, 6)]) == 7
    # islands that are down do not count while any is up
    assert fleet_latest([_view("a", 5, 5), _view("down", 5, HUGE, reachable=False)]) == 5


def test_an_island_that_will_wait_is_not_ready() -> None:
    lag0 = Constraint(max_lag=0)
    liar = _view("liar", 5, HUGE)
    assert tier_of(liar, lag0, 5) == Tier.CATCH_UP  # its sidecar would wait for 10^12
    assert tier_of(_view("a", 5, 5), lag0, 5) == Tier.READY
    assert tier_of(liar, Constraint(min_version=5), 5) == Tier.READY  # its bits are fine
    assert tier_of(_view("ahead", 5, 6), lag0, 5) == Tier.CATCH_UP  # it saw 6: it catches up


def test_choose_routes_around_an_inflated_latest_and_repair_does_not_stick() -> None:
    gw = Gateway(["a=http://a:1", "b=http://b:1", "liar=http://liar:1"])
    for name in ("a", "b"):
        gw.observe_version(name, {"served": 9, "latest": 9, "state": "IDLE"})
    gw.observe_version("liar", {"served": 9, "latest": HUGE, "state": "ERROR"})
    assert gw.latest() == 9
    lag1 = Constraint(max_lag=1)
    picks = {gw.choose(lag1, [], None, rotate=r).name for r in range(6)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}
    gw.observe_version("liar", {"served": 9, "latest": 9, "state": "IDLE"})  # repaired
    assert gw.views()[2].latest == 9
    picks = {gw.choose(lag1, [], None, rotate=r).name for r in range(6)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "liar"}


@pytest.fixture
def islands() -> Iterator[Callable[[dict[str, object]], str]]:
    """``island(answer) -> url``: a fake island whose ``/version`` says ``answer``."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(answer: dict[str, object]) -> str:
        body = json.dumps(answer).encode()

        class Island(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Island)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_polled_liar_does_not_move_the_fleet(islands: Callable[[dict[str, object]], str]) -> None:
    honest = {"served": 3, "latest": 3, "state": "IDLE", "run": "r1"}
    urls = [
        islands(honest),
        islands(honest),
        islands({"served": 3, "latest": HUGE, "state": "ERROR", "run": "r1"}),
    ]
    gw = Gateway([f"a={urls[0]}", f"b={urls[1]}", f"liar={urls[2]}"], GatewayConfig(poll_s=0.05))
    gw.start()
    try:
        deadline = time.monotonic() + 30
        while not all(v.reachable for v in gw.views()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert gw.latest() == 3
        lags = {d["name"]: d["lag"] for d in gw.describe()}
        assert lags == {"a": 0, "b": 0, "liar": 0}
    finally:
        gw.stop()
