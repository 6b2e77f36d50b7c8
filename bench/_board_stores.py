"""The stores of ``bench/board.py``: moto's S3 server, the mirror of a run, a replica's peak RSS."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollpatch.store import Store

BUCKET = "rollpatch-bench"

HERE = Path(__file__).resolve().parent


def child_peak_rss(needle: str) -> int | None:
    """VmHWM of this process's child whose command line contains ``needle`` (Linux)."""
    proc = Path("/proc")
    try:
        kids = [
            int(k)
            for t in (proc / str(os.getpid()) / "task").iterdir()
            for k in (t / "children").read_text().split()
        ]
        for k in kids:
            cmd = (proc / str(k) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if needle in cmd:
                for line in (proc / str(k) / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def s3_server() -> Iterator[Any]:
    """moto's standalone server on loopback (tests/s3server.py), with the bench bucket."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3server import moto_available, run_moto_server  # type: ignore[import-not-found]

    if not moto_available():
        raise SystemExit(
            "--stores s3 needs moto's standalone server: pip install "
            "'moto[server]' boto3 (or use --stores file)"
        )
    import boto3

    with run_moto_server() as server:
        boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name=server.region,
            aws_access_key_id=server.access_key_id,
            aws_secret_access_key=server.secret_access_key,
        ).create_bucket(Bucket=BUCKET)
        yield server


def mirror(src: Store, dst: Store, run: str) -> tuple[int, int, float]:
    """Copy a run (objects, manifests, markers, then LATEST) byte for byte."""
    t0 = time.perf_counter()
    keys = src.list(f"runs/{run}/")
    order = sorted(keys, key=lambda k: (k.endswith("/LATEST"), "/versions/" in k, k))
    nbytes = 0
    for k in order:
        data = src.get(k)
        dst.put(k, data)
        nbytes += len(data)
    return len(keys), nbytes, time.perf_counter() - t0
