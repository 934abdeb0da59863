"""The import graph of the production packages: no cycles between modules, bench out of production code, Ray in
shmbroker.ray alone, and a command parser that loads neither bench nor the client library nor an inference
runtime. In tests/, no module imports a test module: shared helpers live in tests/conftest.py or a helper module
(tests/models.py, ...)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("broker", "gpu_worker", "client", "frontend", "ray")  # production code: shmbroker.<folder>
TOP_NAMES = ("broker", "gpu_worker", "client", "frontend", "bench", "configs")  # folders, never import names


def _modules() -> dict[str, Path]:
    """Every production module by name, read through shmbroker/ (its links to the role folders, and shmbroker/ray)."""
    out = {"shmbroker": REPO / "shmbroker" / "__init__.py"}
    for package in PACKAGES:
        folder = REPO / "shmbroker" / package
        for path in folder.rglob("*.py"):
            parts = ("shmbroker", package, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module, name: str, is_package: bool) -> Iterator[str]:
    """Every module ``tree`` imports, at module level or inside a function (a lazy import is still a
    dependency), except under ``if TYPE_CHECKING``; ``from pkg import x`` also yields ``pkg.x``."""
    hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              for n in ast.walk(node)}
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        deps = set(_imports(tree, name, path.name == "__init__.py"))
        graph[name] = {d for d in deps if d in mods and d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_production_modules_import_without_cycles() -> None:
    assert _cycles(_graph()) == []


def _absolute_imports(path: Path) -> set[str]:
    """The modules a file names in ``import X`` and ``from X import ...`` (relative imports left out)."""
    return {n for node in ast.walk(ast.parse(path.read_text()))
            for n in ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                      else [a.name for a in node.names] if isinstance(node, ast.Import) else [])}


def _python(code: str, cwd: Path = REPO) -> str:
    """What a fresh interpreter prints for ``code``."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def test_only_the_cli_imports_bench_and_only_inside_the_bench_command() -> None:
    """`shmbroker bench` is the one door from production code into bench, opened when that command runs
    (a bare ``bench`` import is refused by the next test, like every folder name)."""
    offenders = {m for m, path in _modules().items()
                 if any(n == "shmbroker.bench" or n.startswith("shmbroker.bench.") for n in _absolute_imports(path))}
    assert offenders == {"shmbroker.broker.cli"}


def test_only_shmbroker_ray_imports_ray() -> None:
    """Ray is the [ray] extra's: no other production module names it, lazily or not, nor any bench module but
    the benchmark of that extra (bench/ray_bench.py, which `shmbroker bench --ray` loads when it runs)."""
    offenders = {m for m, path in _modules().items() if not (m == "shmbroker.ray" or m.startswith("shmbroker.ray."))
                 and any(n.split(".")[0] in ("ray", "starlette") for n in _absolute_imports(path))}
    offenders |= {p.name for p in (REPO / "bench").glob("*.py") if p.name != "ray_bench.py"
                  and any(n.split(".")[0] in ("ray", "starlette") for n in _absolute_imports(p))}
    assert offenders == set()
    users = {m for m, path in _modules().items() if not m.startswith("shmbroker.ray")
             and any(n == "shmbroker.ray" or n.startswith("shmbroker.ray.") for n in _absolute_imports(path))}
    assert users == set()


def test_the_core_loads_no_ray() -> None:
    """The client, the broker, its worker and the front-ends run where Ray is not installed."""
    code = ("import sys, shmbroker.client, shmbroker.broker.cli, shmbroker.broker.serving.service, "
            "shmbroker.gpu_worker.worker, shmbroker.frontend.server, shmbroker.frontend.kserve; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'starlette'}))")
    assert _python(code) == "[]"


def test_everything_imports_through_the_one_name_shmbroker() -> None:
    """The repo's folders are not import names: an installed wheel has only ``shmbroker``."""
    offenders = {}
    for path in [*REPO.glob("*/**/*.py")]:
        top = path.parts[len(REPO.parts)]
        if top.startswith(".") or top in ("build", "shmbroker", "examples"):  # .venv, CI's other venvs, caches
            continue
        bare = sorted(n for n in _absolute_imports(path) if n.split(".")[0] in TOP_NAMES)
        if bare:
            offenders[str(path.relative_to(REPO))] = bare
    assert offenders == {}


def test_the_command_parser_loads_no_bench_client_or_runtime() -> None:
    code = ("import sys; from shmbroker.broker import cli; cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnxruntime', 'torch', 'tensorrt', 'aiohttp') "
            "or m.startswith(('shmbroker.bench', 'shmbroker.client'))))")
    assert _python(code) == "[]"


def test_the_gpu_engines_load_no_onnxruntime() -> None:
    """A GPU worker's engines share metadata with the ONNX Runtime engine without importing ONNX Runtime."""
    code = ("import sys; import shmbroker.gpu_worker.engines.meta, shmbroker.gpu_worker.engines.inductor, "
            "shmbroker.gpu_worker.engines.tensorrt, shmbroker.gpu_worker.engines.torch; "
            "print('onnxruntime' in sys.modules)")
    assert _python(code) == "False"


def test_no_module_under_tests_imports_a_test_module() -> None:
    """A test module is run, not imported: what two modules share lives in conftest.py or a helper module under
    tests/ (models.py, frontends.py, faultload.py, rawclient.py, gpu/clients.py), lazy imports included."""
    offenders: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        deps = set()
        for dep in _imports(ast.parse(path.read_text(), str(path)), name, is_package):
            where = dep.split(".")
            tests = [i for i, part in enumerate(where) if part.startswith("test_")]
            if where[0] == "tests" and tests:
                deps.add(".".join(where[: tests[0] + 1]))  # the test module, not the names taken from it
        if deps:
            offenders[name] = sorted(deps)
    assert offenders == {}


def test_the_top_package_loads_the_client_only_when_asked() -> None:
    """`import shmbroker` (as every process does, being the parent of all) costs no client library; the client
    API is one attribute away."""
    code = ("import sys, shmbroker; before = 'shmbroker.client' in sys.modules; "
            "from shmbroker import AsyncClient, Client, WorkerDied; "
            "print(before, Client.__module__, AsyncClient.__module__, WorkerDied.__module__)")
    assert _python(code, cwd=Path("/")).split() == ["False", "shmbroker.client.client", "shmbroker.client.aio",
                                                    "shmbroker.client.errors"]
