"""Bounded strict JSON, and every parser of untrusted metadata built on it (issue 11).

Hostile documents (deep nesting, NaN/Infinity, 1e400, lone surrogates, duplicate keys, a dict
where a string belongs) must end in the parser's typed rollpatch error, never RecursionError,
UnicodeError, TypeError or OverflowError.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from rollpatch import jsonsafe
from rollpatch.errors import ConfigError, ManifestError, RollpatchError, ViewError
from rollpatch.io import view_from_bytes, view_to_bytes
from rollpatch.manifest import KeyframeObject, Manifest
from rollpatch.types import ObjectRef
from rollpatch.view import Tensor, View
from tests.conftest import make_manifest

D = "a" * 64

HOSTILE = {
    "nan": b"[NaN]",
    "infinity": b'{"a": Infinity}',
    "minus_infinity": b"-Infinity",
    "huge_float": b"[1e400]",
    "huge_int": b"1" + b"0" * 5000,
    "deep_list": b"[" * 100_000 + b"]" * 100_000,
    "deep_object": b'{"a":' * 1000 + b"1" + b"}" * 1000,
    "unterminated_deep": b"[" * 1_000_000,
    "lone_surrogate": b'{"name": "\\ud800"}',
    "lone_low_surrogate_key": b'{"\\udfff": 1}',
    "duplicate_keys": b'{"a": 1, "a": 2}',
    "not_utf8": b'{"a": "\xff"}',
    "empty": b"",
    "trailing": b"{} {}",
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_documents_are_refused_with_the_callers_error(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="refused") as e:
        jsonsafe.loads(raw, what="thing", error=ManifestError, run="r1")
    assert e.value.context["run"] == "r1"


def test_bounds_and_what_is_accepted() -> None:
    ok = b'{"a": [1, -2.5e3, "\\ud83d\\ude00", "]]]\\"[[[", null, true], "b": {}}'
    assert jsonsafe.loads(ok) == {"a": [1, -2500.0, "😀", ']]]"[[[', None, True], "b": {}}
    assert jsonsafe.nesting_depth(ok) == 2 and jsonsafe.nesting_depth(b"1") == 0
    assert jsonsafe.nesting_depth(b'["[[[[", {"x": "}}"}]') == 2
    with pytest.raises(ConfigError) as e:
        jsonsafe.loads(b"[" + b"1," * 100 + b"1]", max_bytes=100)
    assert e.value.context["limit"] == "size"
    jsonsafe.loads(b"[[[1]]]", max_depth=3)
    with pytest.raises(ConfigError, match="nested 4 deep"):
        jsonsafe.loads(b"[[[[1]]]]", max_depth=3)
    assert jsonsafe.loads('{"k": "é"}') == {"k": "é"}  # str input too
    # more brackets than max_depth, most inside strings: scanned, and accepted by depth
    assert jsonsafe.loads(b'["' + b"[{" * 40 + b'", [1]]', max_depth=3) == ["[{" * 40, [1]]
    with pytest.raises(ConfigError, match="nested 4 deep"):  # four brackets, all real
        jsonsafe.loads(b'[["[[[[", [[1]]]]', max_depth=3)


# -- manifests ---------------------------------------------------------------------------------


def _manifest_doc() -> dict:
    m = make_manifest(
        "r1",
        1,
        target=D,
        view_bytes=10,
        created=0.0,
        publisher="t",
        keyframes=(KeyframeObject(ObjectRef("runs/r1/objects/k", 1, D)),),
    )
    return m.to_json()


@pytest.mark.parametrize(
    "field, value",
    [
        ("format", {"codec": "x"}),
        ("format", ["bf16"]),
        ("run", {"a": 1}),
        ("version", 1.5),
        ("version", "1"),
        ("created", None),
        ("publisher", 7),
        ("meta", {"k": 1}),
        ("keyframes", {"key": "x"}),
        ("target", 12),
        ("shards", True),
    ],
)
def test_manifest_wrong_types_are_manifest_errors(field: str, value: object) -> None:
    doc = _manifest_doc()
    doc[field] = value
    with pytest.raises(ManifestError):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_manifest_hostile_json(raw: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(raw)


def test_manifest_hostile_values_inside_a_valid_shape() -> None:
    good = json.dumps(_manifest_doc()).encode()
    assert Manifest.from_bytes(good).version == 1
    for old, new in (
        (b'"created": 0.0', b'"created": 1e400'),
        (b'"created": 0.0', b'"created": NaN'),
        (b'"publisher": "t"', b'"publisher": "\\ud800"'),
        (b'"meta": {}', b'"meta": {"k": "v", "k": "w"}'),
        (b'"meta": {}', b'"meta": ' + b"[" * 5000 + b"]" * 5000),
    ):
        assert old in good
        with pytest.raises(ManifestError):
            Manifest.from_bytes(good.replace(old, new))


# -- safetensors headers -----------------------------------------------------------------------


def _safetensors(header: bytes, data: bytes = b"\0" * 8) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def test_safetensors_round_trip_still_works() -> None:
    from rollpatch.kinds import KINDS

    view = View({"w\x1b[31m": Tensor(KINDS["bf16"], (2, 2), np.arange(4, dtype=np.uint16))})
    back = view_from_bytes(view_to_bytes(view))
    assert back.digest() == view.digest()


@pytest.mark.parametrize(
    "header",
    [
        *HOSTILE.values(),
        b'{"w": {"dtype": {"x": 1}, "shape": [4], "data_offsets": [0, 8]}}',  # unhashable dtype
        b'{"w": {"dtype": ["BF16"], "shape": [4], "data_offsets": [0, 8]}}',
        b'{"\\ud800": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}',  # lone surrogate
        b'{"w": {"dtype": "BF16", "shape": [1e400], "data_offsets": [0, 8]}}',
        b'{"w": {"dtype": "BF16", "shape": [4.0], "data_offsets": [0, 8]}}',
        (
            b'{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}, '
            b'"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}'
        ),  # duplicate name
        b'{"__metadata__": {"rollpatch.kinds": "' + b"[" * 5000 + b'"}}',
        b'{"__metadata__": {"rollpatch.kinds": "{\\"w\\": {\\"a\\": 1}}"}}',
        (
            b'{"__metadata__": {"rollpatch.kinds": "{\\"w\\": \\"no-such-kind\\"}"}, '
            b'"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}'
        ),
        b'{"__metadata__": {"k": {"nested": "x"}}}',
        b'{"__metadata__": {"k": NaN}}',
    ],
    ids=[
        *HOSTILE.keys(),
        "dtype_dict",
        "dtype_list",
        "surrogate_name",
        "huge_dim",
        "float_dim",
        "duplicate_name",
        "kinds_deep",
        "kinds_dict",
        "kinds_unknown",
        "meta_nested",
        "meta_nan",
    ],
)
def test_safetensors_hostile_headers_are_view_errors(header: bytes) -> None:
    with pytest.raises(ViewError):
        view_from_bytes(_safetensors(header))


def test_every_refusal_is_a_rollpatch_error() -> None:
    for raw in HOSTILE.values():
        for parse in (Manifest.from_bytes, lambda r: view_from_bytes(_safetensors(r))):
            with pytest.raises(RollpatchError):
                parse(raw)
