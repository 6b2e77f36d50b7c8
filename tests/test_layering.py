"""The package's layering (docs/architecture.md), enforced.

Every top-level unit of ``rollpatch`` (a subpackage or a module) sits on a layer; a unit may
import units of its own layer or below, never above. Imports are read from the source (AST),
including imports inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rollpatch"

#: Layer of each unit, lowest first (the picture in docs/architecture.md).
LAYERS: dict[str, int] = {
    # 0 vocabulary: no I/O, imports nothing of ours but errors
    "errors": 0,
    "types": 0,
    "jsonsafe": 0,
    "logs": 0,
    "validate": 0,
    "kinds": 0,
    # 1 pure rules and the compiled core
    "native": 1,
    "digests": 1,
    "view": 1,
    "layout": 1,
    "protocol": 1,
    "config": 1,
    "liveness": 1,
    # 2 bits: formats, the patch codec, files, trust, simulated training
    "formats": 2,
    "patch": 2,
    "io": 2,
    "trust": 2,
    "sim": 2,
    # 3 documents and bytes: LATEST, manifests, stores, the HTTP edge kit
    "latest": 3,
    "manifest": 3,
    "store": 3,
    "objects": 3,
    "serving": 3,
    # 4 the board: layout in a store, planning, replay
    "planning": 4,
    "avoid": 4,
    "board": 4,
    "replay": 4,
    # 5 what uses a board or a view: retention, engine adapters, analysis
    "retention": 5,
    "engines": 5,
    "analysis": 5,
    # 6 the two sides of the board
    "publisher": 6,
    "follower": 6,
    # 7 network services
    "sidecar": 7,
    "relay": 7,
    "gateway": 7,
    "netem": 7,
    # 8 applications
    "demo": 8,
    "cli": 8,
    "__main__": 8,
}


def _units() -> set[str]:
    out = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    return out | {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}


def _imports() -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, "file:line")} for every import of another unit."""
    edges: dict[str, set[tuple[str, str]]] = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        unit = parts[0]
        package = list(parts[:-1])
        if parts[-1] == "__init__" and len(parts) == 1:
            continue  # rollpatch/__init__: the public facade, not a layer
        for node in ast.walk(ast.parse(f.read_text())):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    mod = base + (node.module.split(".") if node.module else [])
                    targets = [mod] if node.module else [mod + [a.name] for a in node.names]
                elif node.module and node.module.split(".")[0] == "rollpatch":
                    targets = [node.module.split(".")[1:]]
            elif isinstance(node, ast.Import):
                targets = [
                    a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "rollpatch"
                ]
            for t in targets:
                if t and t[0] != unit and t[0] in _units():
                    edges.setdefault(unit, set()).add(
                        (t[0], f"{f.relative_to(SRC.parent)}:{node.lineno}")
                    )
    return edges


def test_every_unit_has_a_layer() -> None:
    assert _units() - set(LAYERS) == set(), "place the new unit on a layer (and in the doc)"
    assert set(LAYERS) - _units() == set(), "a unit was removed: drop it from LAYERS"


def test_no_unit_imports_upward() -> None:
    edges = _imports()
    # the scanner sees relative, absolute and function-level imports
    assert {"board", "replay"} <= {dep for dep, _ in edges["publisher"]}
    assert "io" in {dep for dep, _ in edges["objects"]}  # lazy, inside objects.fetch_view
    upward = sorted(
        f"{where}: {unit} (layer {LAYERS[unit]}) imports {dep} (layer {LAYERS[dep]})"
        for unit, deps in edges.items()
        for dep, where in deps
        if LAYERS[dep] > LAYERS[unit]
    )
    assert upward == []


def test_the_two_sides_of_the_board_do_not_import_each_other() -> None:
    edges = _imports()
    assert "follower" not in {dep for dep, _ in edges["publisher"]}
    assert "publisher" not in {dep for dep, _ in edges["follower"]}


def test_the_architecture_doc_names_every_unit() -> None:
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    missing = [u for u in LAYERS if u != "__main__" and f"`{u}`" not in doc]
    assert missing == []


_KEY_SPELLING = re.compile(r"^(runs|root)/|(^|/)(versions|keyframes)/|/LATEST$")


def test_only_layout_spells_board_keys() -> None:
    """String literals that spell a board key appear in rollpatch.layout only."""
    found = []
    for f in SRC.rglob("*.py"):
        if f == SRC / "layout.py":
            continue
        tree = ast.parse(f.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        found += [
            f"{f.relative_to(SRC.parent)}:{n.lineno} {n.value!r}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and id(n) not in docs
            and _KEY_SPELLING.search(n.value)
        ]
    assert found == []


#: The patch codec and what drives it. (``rollpatch.native`` is not on the list: ``import
#: rollpatch`` loads it for the view digests.)
_CODEC = ("rollpatch.patch", "rollpatch.follower", "rollpatch.engines", "rollpatch.publisher")


def _loaded_by(module: str) -> list[str]:
    code = (
        f"import sys, {module}; "
        f"print('\\n'.join(m for m in sys.modules if m.startswith({_CODEC!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return sorted(out.split())


def test_the_protocol_and_layout_load_no_codec() -> None:
    assert _loaded_by("rollpatch.protocol") == []
    assert _loaded_by("rollpatch.layout") == []


def test_importing_the_gateway_loads_no_codec() -> None:
    """The gateway routes requests: it needs the HTTP edge kit (``serving``) and the request
    protocol, never an engine, a follower or the codec."""
    assert _loaded_by("rollpatch.gateway") == []
    assert _loaded_by("rollpatch.gateway.app") == []
    assert _loaded_by("rollpatch.serving") == []
