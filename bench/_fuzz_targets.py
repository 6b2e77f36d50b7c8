"""The parsers ``bench/fuzz_services.py`` fuzzes, and their seed inputs (real documents).

Each target takes untrusted bytes and must either accept them or refuse them with a
:class:`~rollpatch.errors.RollpatchError` (the typed refusal every caller maps to a status or
an exit code). Any other exception is a crash; an input that takes longer than libFuzzer's
``-timeout`` is a hang. Seeds are made here, from a real signed board, so the fuzzer starts
from documents the code accepts and mutates into what it must refuse.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RUN = "fz"
TARGET_NAMES = (
    "manifest",
    "latest",
    "latest-unsigned",
    "root",
    "safetensors",
    "relay-cache",
    "request",
    "island-answer",
)
Target = Callable[[bytes], None]


class Env:
    """A signed board with two versions, its trust root, and a scratch directory."""

    def __init__(self) -> None:
        from rollpatch.board import Board, pointer_key, version_key
        from rollpatch.formats import cast_view
        from rollpatch.io.safetensors import view_to_bytes
        from rollpatch.publisher import Publisher, PublisherConfig
        from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

        key = SigningKey.generate()
        self.root_bytes = sign_root(Root.new([key.public]), [key])
        self.trust = Trust(self.root_bytes)
        self.board = Board("memory://fuzz-services", trust=self.trust)
        rng = np.random.default_rng(0)
        masters = {
            "layer.w": rng.standard_normal((16, 16)).astype(np.float32),
            "layer.b": rng.standard_normal(16).astype(np.float32),
        }
        pub = Publisher(
            self.board, RUN, PublisherConfig(signer=Signer(keys=(key,))), asynchronous=False
        )
        for _ in range(2):
            pub.publish(masters)
            masters["layer.w"] += 0.05
        pub.flush()
        store = self.board.store
        self.manifests = [store.get(version_key(RUN, v)) for v in (0, 1)]
        self.latest = store.get(pointer_key(RUN))
        self.bare_manifest = _payload(self.manifests[1])
        self.safetensors = view_to_bytes(cast_view(masters, "bf16"), {"note": "seed"})
        self.scratch = Path(tempfile.mkdtemp(prefix="rp-fuzz-"))
        self.cache_file = self._cache_file()

    def _cache_file(self) -> bytes:
        import blake3

        from rollpatch.relay.cache import DiskCache

        data = b"patch bytes"
        key = self.board.put_object(RUN, data, "rpatch").key
        cache = DiskCache(self.scratch / "seed-cache", 1 << 20)
        entry = cache.insert(key, data, blake3.blake3(data).hexdigest())
        return Path(entry.path).read_bytes()


def _payload(envelope: bytes) -> bytes:
    import base64

    return base64.b64decode(json.loads(envelope)["payload"])


REQUESTS = [
    {
        "model": "m",
        "prompt": "12 + 7 =",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        "rollpatch": {"min_version": 1, "wait_s": 0},
    },
    {"prompt": [[1, 2, 3]], "stream": True, "stop": ["\n"], "n": 1, "seed": 7},
    {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
        "rollpatch": {"max_lag": 2, "exact_version": 3},
    },
]


def targets(env: Env) -> dict[str, tuple[Target, list[bytes]]]:
    """name → (function of the input, seed inputs)."""
    from rollpatch.errors import RollpatchError
    from rollpatch.gateway import Gateway
    from rollpatch.gateway.proxy import add_island
    from rollpatch.io.safetensors import view_from_bytes
    from rollpatch.latest import read_latest
    from rollpatch.manifest import Manifest, open_manifest
    from rollpatch.relay.cache import _read_entry
    from rollpatch.serving.body import BodyLimits, parse_json_object
    from rollpatch.serving.schema import ROUTES, validate_body
    from rollpatch.sidecar.protocol import annotate_body, parse_constraint
    from rollpatch.trust import verify_initial_root

    limits = BodyLimits(max_bytes=1 << 20)
    routes = sorted(ROUTES)
    gw = Gateway(["a=http://127.0.0.1:9"])
    cache_path = env.scratch / "fuzzed-entry"

    def refusing(fn: Callable[[bytes], Any]) -> Target:
        def run(data: bytes) -> None:
            try:
                fn(data)
            except RollpatchError:
                pass  # a typed refusal is the right answer to hostile bytes

        return run

    def manifest(data: bytes) -> None:
        for v in (0, 1):
            open_manifest(data, RUN, v, env.trust)
        Manifest.from_bytes(data)

    def request(data: bytes) -> None:
        body = parse_json_object(data, limits)
        validate_body(routes[len(data) % 2], dict(body))
        headers = {"x-rollpatch-max-lag": data[:8].decode("latin-1")}
        parse_constraint(body, headers)

    def island(data: bytes) -> None:  # what a hostile island can answer the gateway
        add_island(data, "a")
        annotate_body(data, 1, 2)
        from rollpatch import jsonsafe

        doc = jsonsafe.loads(data, max_bytes=1 << 20, max_depth=8)
        if isinstance(doc, dict):
            gw.observe_version("a", doc)

    def cache_entry(data: bytes) -> None:
        cache_path.write_bytes(data)
        _read_entry(cache_path)  # never raises: a bad file is reported and discarded

    bodies = [json.dumps(r).encode() for r in REQUESTS]
    version = json.dumps({"served": 3, "latest": 4, "state": "IDLE", "run": RUN}).encode()
    return {
        "manifest": (refusing(manifest), [*env.manifests, env.bare_manifest]),
        "latest": (refusing(lambda d: read_latest(d, RUN, env.trust)), [env.latest]),
        "latest-unsigned": (refusing(lambda d: read_latest(d, RUN, None)), [_payload(env.latest)]),
        "root": (refusing(verify_initial_root), [env.root_bytes]),
        "safetensors": (refusing(view_from_bytes), [env.safetensors]),
        "relay-cache": (cache_entry, [env.cache_file]),
        "request": (refusing(request), bodies),
        "island-answer": (refusing(island), [version, b'{"choices": [], "rollpatch": {}}']),
    }
