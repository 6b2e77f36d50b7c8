"""``rollpatch sidecar --trust``: a real sidecar process over a signed board (issue 11).

The attacker writes a version signed with their own key (and moves LATEST to it); the island
keeps serving its last good version, reports the refusal, and takes the next honest version once
the board is repaired. Responses come through the real ``openai`` client.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai

from rollpatch.board import Board
from rollpatch.engines.reference import ReferenceRuntime
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.trust import Root, Signer, SigningKey, sign_root
from tests.conftest import free_port, make_manifest, until

RUN = "r1"


def _served(url: str) -> int | None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="model", prompt="1 + 1 =", max_tokens=2, temperature=0
    )
    return int(raw.headers["x-rollpatch-version-end"])


def test_sidecar_with_trust_keeps_its_version_under_a_forgery(
    tmp_path: Path, tiny_model: Path
) -> None:
    model = tiny_model
    masters = {
        n: t.to_array().astype(np.float32)
        for n, t in ReferenceRuntime(model, threads=1).view.items()
    }
    key = SigningKey.generate()
    (tmp_path / "root.json").write_bytes(sign_root(Root.new([key.public]), [key]))
    board = f"file://{tmp_path / 'board'}"
    pub = Publisher(board, RUN, PublisherConfig(signer=Signer(keys=(key,))), asynchronous=False)
    rng = np.random.default_rng(0)

    def step() -> int:
        for m in masters.values():
            if m.ndim == 2:
                m += (0.01 * rng.standard_normal(m.shape)).astype(np.float32)
        return pub.publish(masters)

    assert pub.publish(masters) == 0 and step() == 1
    port = free_port()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollpatch",
            "sidecar",
            "--board",
            board,
            "--run",
            RUN,
            "--engine",
            "reference",
            "--model",
            str(model),
            "--port",
            str(port),
            "--threads",
            "1",
            "--poll",
            "0.05",
            "--trust",
            str(tmp_path / "root.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                r = httpx.get(f"{url}/ready", timeout=2)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json()["version"] == 1

        until(ready, "the sidecar to serve version 1", timeout=90)
        assert _served(url) == 1
        # the attacker: version 2 signed with their own key, LATEST moved to it
        evil = Board(board, signer=Signer(keys=(SigningKey.generate(),)))
        m1 = evil.manifest(RUN, 1)
        forged = make_manifest(
            RUN,
            2,
            fmt=m1.format,
            target=m1.target,
            view_bytes=m1.view_bytes,
            publisher="evil",
            patches=m1.patches,
            keyframes=m1.keyframes,
        )
        evil.put_manifest(forged)
        evil.advance(RUN, 2)

        def refused() -> bool:
            info = httpx.get(f"{url}/version", timeout=5).json()
            return "TrustError" in str(info)

        until(refused, "the sidecar to report the forgery", timeout=90)
        assert _served(url) == 1  # still the last good version
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": "model",
                "prompt": "1 + 1 =",
                "max_tokens": 2,
                "rollpatch": {"min_version": 2, "wait_s": 0},
            },
            timeout=30,
        )
        assert r.status_code == 409
        # the honest publisher goes on: it replaces the squatted version 2 and the forged
        # LATEST (none of its keys signed them), and the island takes version 2
        assert step() == 2

        def at_two() -> bool:
            return bool(_served(url) == 2)

        until(at_two, "the honest version 2", timeout=90)
        assert list((tmp_path / "state" / "rollpatch").glob("trust-*.json"))
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
        pub.close()
    assert "verification is OFF" not in out
