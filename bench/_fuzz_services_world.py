"""The services ``bench/fuzz_services.py`` attacks with schemathesis: a real sidecar (built-in
engine, tiny model, one published version), a gateway in front of it and a relay of the
board, each a uvicorn server on a loopback port in this process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

RUN = "fz"
ANSWER_S = 60.0
Check = Callable[[Any, Any], str | None]


class _Errors(logging.Handler):
    """Counts ERROR records (an unexpected exception in any server logs one, with traceback)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()[:200]}")


def check_case(case: Any, response: Any) -> str | None:
    """Why an answer is a failure (None: it is not)."""
    status = response.status_code
    if status == 500 or status >= 600:
        return f"status {status}"
    if (
        400 <= status < 500
        and case.operation.path.startswith("/v1/")
        and "json" in response.headers.get("content-type", "")
    ):
        try:
            body = response.json()
        except ValueError:
            return f"{status} with a body that is not JSON"
        if not isinstance(body, dict) or "error" not in body:
            return f"{status} without an error object"
    return None


class World:
    """``with World(dir) as w:`` everything is served; stopped on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.errors = _Errors()
        self._stop: list[Callable[[], None]] = []

    def __enter__(self) -> World:  # noqa: PYI034 (typing.Self needs 3.11)
        from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime, make_tiny_model
        from rollpatch.follower import FollowerConfig
        from rollpatch.gateway import GatewayConfig
        from rollpatch.gateway.server import start_gateway
        from rollpatch.publisher import Publisher
        from rollpatch.relay import RelayConfig, RelayServer
        from rollpatch.sidecar import SidecarConfig
        from rollpatch.sidecar.server import start_sidecar

        logging.getLogger().addHandler(self.errors)
        self.root.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(self.root / f"model-{time.time_ns()}", seed=0)
        oracle = ReferenceRuntime(model, threads=1)
        masters = {n: t.to_array().astype(np.float32) for n, t in oracle.view.items()}
        board = f"file://{self.root / f'board-{time.time_ns()}'}"
        pub = Publisher(board, RUN, asynchronous=False)
        self.version = pub.publish(masters)
        pub.flush()
        engine = ReferenceEngine.from_dir(model, threads=1)
        self.sidecar = start_sidecar(
            board,
            RUN,
            engine,
            engine.url,
            config=SidecarConfig(follower=FollowerConfig(poll_s=0.2)),
        )
        self._stop.append(self.sidecar.stop)
        self.gateway = start_gateway([f"a={self.sidecar.url}"], config=GatewayConfig())
        self._stop.append(self.gateway.stop)
        self.relay = RelayServer(board, RelayConfig(cache_dir=self.root / "relay-cache"))
        self.relay.start()
        self._stop.append(self.relay.stop)
        deadline = time.monotonic() + 120
        while self.sidecar.sidecar.follower.version != self.version:
            if time.monotonic() > deadline:
                raise RuntimeError("the sidecar never loaded the published version")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        for stop in reversed(self._stop):
            stop()
        logging.getLogger().removeHandler(self.errors)

    def services(self) -> dict[str, str]:
        return {"sidecar": self.sidecar.url, "gateway": self.gateway.url, "relay": self.relay.url}

    def fuzz(self, url: str, cases: int, check: Check) -> Iterator[tuple[str, str, int, int, int]]:
        """Per operation and mode: ``(operation, mode, cases sent, failures, hangs)``."""
        import requests
        import schemathesis
        from hypothesis.errors import Unsatisfiable
        from schemathesis import GenerationMode

        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        session = requests.Session()
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                tally = {"sent": 0, "failures": 0, "hangs": 0}
                attack = self._attack(op, mode, url, cases, check, session, tally)
                try:
                    attack()
                except Unsatisfiable:
                    pass  # no negative case exists (an operation without inputs)
                yield (
                    f"{op.method.upper()} {op.path}",
                    mode.value,
                    tally["sent"],
                    tally["failures"],
                    tally["hangs"],
                )

    @staticmethod
    def _attack(
        op: Any, mode: Any, url: str, cases: int, check: Check, session: Any, tally: dict[str, int]
    ) -> Callable[[], None]:
        import requests
        from hypothesis import HealthCheck, Phase, given, settings
        from schemathesis import GenerationMode

        @settings(
            max_examples=cases,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(op.as_strategy(generation_mode=mode))
        def attack(case: Any) -> None:
            if (
                mode == GenerationMode.POSITIVE
                and isinstance(case.body, dict)
                and op.path.startswith("/v1/")
                and op.method.upper() == "POST"
            ):
                # valid requests do generate: keep each short (the engine's speed is not
                # what this measures); invalid ones are sent exactly as generated
                case.body["max_tokens"] = min(int(case.body.get("max_tokens") or 4), 4)
                case.body["n"] = min(int(case.body.get("n") or 1), 2)
            try:
                response = case.call(base_url=url, session=session, timeout=ANSWER_S)
            except requests.Timeout:
                tally["sent"] += 1
                tally["hangs"] += 1
                print(f"HANG {case.as_curl_command()[:300]}")
                return
            except (requests.RequestException, ValueError, TypeError, UnicodeError):
                tally["unsendable"] = tally.get("unsendable", 0) + 1
                return  # the client could not even send it (an invalid header, ...)
            tally["sent"] += 1
            why = check(case, response)
            if why is not None:
                tally["failures"] += 1
                print(f"FAIL {why}: {case.as_curl_command()[:300]}")

        return attack

    def after_campaign(self) -> dict[str, Any]:
        """A real completion through the gateway; what the servers logged at ERROR."""
        import httpx

        r = httpx.post(
            f"{self.gateway.url}/v1/completions",
            timeout=120,
            json={
                "prompt": "12 + 7 =",
                "max_tokens": 4,
                "temperature": 0,
                "rollpatch": {"min_version": self.version},
            },
        )
        rp = r.json().get("rollpatch", {}) if r.status_code == 200 else {}
        for line in self.errors.records[:20]:
            print(f"ERROR RECORD {line}")
        return {
            "served": r.status_code == 200 and rp.get("version_start") == self.version,
            "version": rp.get("version_start"),
            "errors": len(self.errors.records),
            "inflight": self.sidecar.sidecar.gate.inflight,
        }
