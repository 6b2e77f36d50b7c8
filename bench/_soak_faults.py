"""The faults the soak injects into its fleet (bench/_soak_fleet.Fleet inherits them): each
returns a one-line note of what it did."""

from __future__ import annotations

import json
import time
from typing import Any

from _soak_procs import RUN, Proc, S3Board

#: How long the store-outage fault keeps the store down.
OUTAGE_S = 5.0


class Faults:
    """The fault injections, on the fleet's processes and board (``procs``, ``board``,
    ``latest``): mixed into :class:`_soak_fleet.Fleet`."""

    procs: dict[str, Proc]
    board: S3Board | None

    def latest(self) -> int | None:
        raise NotImplementedError

    def _relay_restart(self) -> str:
        relay = self.procs["relay"]
        relay.stop()
        time.sleep(2.0)
        relay.start()
        return "SIGTERM, 2 s down, same port, warm cache"

    def _store_outage(self) -> str:
        assert self.board is not None
        self.board.proxy.down()
        time.sleep(OUTAGE_S)
        self.board.proxy.up()
        return f"connections refused and cut for {OUTAGE_S:.0f} s"

    def _publisher_kill(self) -> str:
        pub = self.procs["publisher"]
        before = self.latest()
        pub.kill9()
        time.sleep(1.0)
        pub.start()
        return f"kill -9 at LATEST {before}; restarted, resumes from the board"

    def _sidecar_kill(self) -> str:
        b = self.procs["b"]
        b.kill9()
        b.start()
        return "kill -9 of island b (relay), restarted"

    def _keys(self, prefix: str) -> list[str]:
        assert self.board is not None
        s3 = self.board.client()
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket="soak-board", Prefix=f"board/runs/{RUN}/{prefix}"
        ):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def _corrupt(self) -> str:
        """Overwrite (bypassing put-if-absent, as an attacker can) the objects of the newest
        keyframe and of the newest patches with garbage of the same size, then kill -9 and
        restart the publisher, which must resume past them."""
        assert self.board is not None
        s3 = self.board.client()
        latest = self.latest() or 0
        marks = sorted(int(k.rsplit("/", 1)[1]) for k in self._keys("keyframes/"))
        versions = {v for v in (marks[-1] if marks else None,) if v is not None}
        versions |= set(range(max(latest - 2, 0), latest + 1))
        hit = 0
        for v in sorted(versions):
            doc = json.loads(
                s3.get_object(Bucket="soak-board", Key=f"board/runs/{RUN}/versions/{v:012d}.json")[
                    "Body"
                ].read()
            )
            payload = doc
            if "payload" in doc:  # a signed envelope
                import base64

                payload = json.loads(base64.b64decode(doc["payload"]))
            for ref in _object_keys(payload):
                key = f"board/{ref}"
                size = s3.head_object(Bucket="soak-board", Key=key)["ContentLength"]
                s3.put_object(Bucket="soak-board", Key=key, Body=b"\x5a" * size)
                hit += 1
        # and the publisher restarts: it must resume around them (or start a new lineage)
        pub = self.procs["publisher"]
        pub.kill9()
        pub.start()
        return f"{hit} objects of versions {sorted(versions)} overwritten; publisher restarted"

    def _forged(self) -> str:
        """An attacker's unsigned manifest far ahead, and an unsigned LATEST naming it; removed
        again after 5 s (the publisher replaces LATEST on its own)."""
        assert self.board is not None
        s3 = self.board.client()
        latest = self.latest() or 0
        v = latest + 100_000
        key = f"board/runs/{RUN}/versions/{v:012d}.json"
        real = s3.get_object(
            Bucket="soak-board", Key=f"board/runs/{RUN}/versions/{latest:012d}.json"
        )["Body"].read()
        doc = json.loads(real)
        if "payload" in doc:
            import base64

            doc = json.loads(base64.b64decode(doc["payload"]))
        doc["version"], doc["parent"] = v, latest
        s3.put_object(Bucket="soak-board", Key=key, Body=json.dumps(doc).encode())
        pointer = {
            "schema": "rollpatch.latest/1",
            "run": RUN,
            "version": v,
            "manifest": f"runs/{RUN}/versions/{v:012d}.json",
            "target": doc.get("target", "0" * 64),
        }
        s3.put_object(
            Bucket="soak-board", Key=f"board/runs/{RUN}/LATEST", Body=json.dumps(pointer).encode()
        )
        time.sleep(5.0)
        s3.delete_object(Bucket="soak-board", Key=key)
        return f"unsigned manifest and LATEST for version {v}"


def _object_keys(manifest: dict[str, Any]) -> list[str]:
    """Every object key a manifest names (patches and keyframe shards)."""
    out = []
    for field in ("patches", "keyframes"):
        for o in manifest.get(field) or []:
            if isinstance(o, dict) and isinstance(o.get("key"), str):
                out.append(o["key"])
    return out
