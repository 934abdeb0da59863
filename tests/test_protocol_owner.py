"""The wire has one owner: no production module but broker/common/protocol.py (every message and layout) and
broker/common/ring.py (the ring segment's byte layout) defines a wire constant or a byte layout. Checked on
the sources with ast, so a new module that packs its own bytes fails here before it can drift from
docs/PROTOCOL.md."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import pytest

from shmbroker.broker.common import protocol as P
from tests.conftest import REPO

OWNERS = {Path("broker/common/protocol.py"), Path("broker/common/ring.py")}
PACKAGES = ("broker", "gpu_worker", "client", "frontend", "bench", "shmbroker")
# the protocol's module-level constants (ENVELOPE, SUBMIT_ENVELOPE, UCRED, MAX_SLOTS, ...) and the kinds' names: a
# module that binds one of these names at its top level to anything but text has its own copy of a wire constant
WIRE_NAMES = {n for n, v in vars(P).items() if n.isupper() and isinstance(v, bytes | int | struct.Struct)} | {
    k.name for k in P.MsgKind}


def _sources() -> list[Path]:
    paths = {p.relative_to(REPO) for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    return sorted(p for p in paths if p not in OWNERS and "__pycache__" not in p.parts)


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name or Attribute chain, else ""."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run at import: the module's own, and those in its top-level if/try blocks."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        stmt = todo.pop(0)
        out.append(stmt)
        if isinstance(stmt, ast.If | ast.Try):
            todo.extend(stmt.body)
            todo.extend(stmt.orelse)
            if isinstance(stmt, ast.Try):
                todo.extend(stmt.finalbody)
                todo.extend(s for h in stmt.handlers for s in h.body)
    return out


def faults(source: str, where: str = "<source>") -> list[str]:
    """What makes ``source`` (a module outside the owners) define a wire constant or layout, one line each."""
    tree = ast.parse(source, where)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import) and any(a.name == "struct" for a in node.names):
            found.append(f"{where}:{line}: imports struct (byte layouts belong in broker/common/protocol.py)")
        elif isinstance(node, ast.ImportFrom) and node.module == "struct":
            found.append(f"{where}:{line}: imports from struct (byte layouts belong in broker/common/protocol.py)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith("ENVELOPE.pack") or name.split(".")[-1] == "envelope":
                found.append(f"{where}:{line}: builds an envelope ({name}); use the protocol's *_ENVELOPE")
    for stmt in _module_level(tree):
        if isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
            text = isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
            for name in sorted(names & WIRE_NAMES if not text else set()):
                found.append(f"{where}:{stmt.lineno}: defines {name}, which broker/common/protocol.py owns")
            if stmt.value is not None and any(_dotted(n).split(".")[-1] == "MsgKind" for n in ast.walk(stmt.value)):
                found.append(f"{where}:{stmt.lineno}: a module-level constant from MsgKind: "
                             f"{ast.unparse(stmt).splitlines()[0]}")
    return found


def test_only_the_protocol_and_the_ring_define_wire_constants_and_layouts() -> None:
    sources = _sources()
    assert Path("client/links.py") in sources and Path("frontend/inline.py") in sources  # the walk finds them
    found = [f for path in sources for f in faults((REPO / path).read_text(), str(path))]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("source", [
    "import struct\nX = struct.Struct('<I')\n",
    "from struct import Struct\n",
    "from shmbroker.broker.common import protocol as P\nSUBMIT_ENVELOPE = P.envelope(P.MsgKind.SUBMIT)\n",
    "from shmbroker.broker.common import protocol as P\nHEAD = P.ENVELOPE.pack(2, 40)\n",
    "from shmbroker.broker.common import protocol as P\ndef f():\n    return P.ENVELOPE.pack(2, 41)\n",
    "from shmbroker.broker.common.protocol import MsgKind\nKIND = int(MsgKind.DONE)\n",
    "INLINE_REQUEST = 40\n",
    "MAX_DIMS: int = 8\n",
    "try:\n    DONE_ENVELOPE: bytes = b'\\x02\\x00\\x21\\x00'\nexcept ImportError:\n    pass\n",
])
def test_the_check_finds_each_kind_of_copy(source: str) -> None:
    assert faults(source)


def test_the_check_lets_a_module_use_the_protocol() -> None:
    source = ("from shmbroker.broker.common import protocol as P\n"
              "from shmbroker.broker.common.protocol import DONE_ENVELOPE\n"
              "OK = int(P.Status.OK)\n"
              "def f(frames):\n"
              "    return frames[0] == DONE_ENVELOPE and P.read_envelope(frames) == P.MsgKind.DONE\n")
    assert faults(source) == []


def test_the_protocol_imports_no_other_module_of_shmbroker() -> None:
    """Every role imports the protocol; it imports none of theirs (the config schema included): the config takes
    the protocol's bounds (sessions.max_slots <= MAX_SLOTS), not the other way round."""
    tree = ast.parse((REPO / "broker/common/protocol.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert sorted(m for m in imported if m.split(".")[0] == "shmbroker") == []


def test_the_config_bounds_the_slots_by_the_protocols_ceiling() -> None:
    """A SUBMIT's size bound (a worker's ZMQ_MAXMSGSIZE) holds for every ring a config allows."""
    from shmbroker.broker.common.config import ConfigError, parse

    assert P.max_submit_bytes(1) == P.SUBMIT_HEADER.size + 2 * P.MAX_SLOTS * (P.REQUEST.size + P.TENSOR.size)
    models = {"m": {"path": "builtin:tiny"}}
    assert parse({"models": models, "sessions": {"max_slots": P.MAX_SLOTS}}).sessions.max_slots == P.MAX_SLOTS
    with pytest.raises(ConfigError, match=f"sessions.max_slots.*{P.MAX_SLOTS}"):
        parse({"models": models, "sessions": {"max_slots": P.MAX_SLOTS + 1}})
