"""Every ```python block of README.md runs as written, as a user would run it: in its own interpreter, with cwd
the repository, against a live broker found through SHMBROKER_RUNTIME_DIR (the snippets say ``Client()``).

A block that needs more than the broker says so in an HTML comment on the line before it,
``<!-- readme-test: needs NAME ... -->``; the test starts what NAME stands for (NEEDS) and fails on a NAME it
does not know, so no block is ever skipped. README also states the Python version pyproject.toml requires.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import PHOTO_MODEL, REPO, TEST_MODELS, RunningBroker, start_broker
from tests.frontends import Front, start_frontend

README = REPO / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*needs\s+(\w+)\b.*-->")
# What a marker may ask for: the HTTP front-end of the README's `shmbroker http --port 8000`. It listens on a
# free port instead (a fixed port may be taken on the test machine), and the block's "localhost:8000" is
# pointed at it: the only change made to any block, checked to be present.
NEEDS = {"http"}
README_HTTP = "localhost:8000"


@dataclass
class Block:
    line: int  # where the block starts in README.md, for the test's id and messages
    code: str
    needs: str | None


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks, each with the need its marker line names (None without a marker)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.search(prev)
            blocks.append(Block(start + 1, "\n".join(lines[start + 1:end]) + "\n", m.group(1) if m else None))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks_and_every_marker_names_a_known_need() -> None:
    assert len(BLOCKS) >= 3, "README's Python snippets were not found: did the fences change?"
    text = README.read_text()
    markers = MARKER.findall(text)
    assert all(n in NEEDS for n in markers), f"unknown readme-test needs {markers}: add them to NEEDS"
    assert len(markers) == text.count("readme-test"), "a readme-test comment the test cannot read"
    assert sum(b.needs is not None for b in BLOCKS) == len(markers), "a readme-test marker not before a block"


def test_readme_states_the_python_version_pyproject_requires() -> None:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=(\d+\.\d+)", requires)
    assert m, f"requires-python {requires!r}: update this test and README's version line"
    assert f"Python {m.group(1)} or newer" in README.read_text()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    # nsfw, nsfw_photo and tiny, as configs/default.toml
    b = start_broker(tmp_path_factory.mktemp("readme"), models=TEST_MODELS + PHOTO_MODEL)
    try:
        yield b
    finally:
        assert b.stop() == 0, b.log()


@pytest.fixture(scope="module")
def http(live: RunningBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    f = start_frontend(live, tmp_path_factory.mktemp("readme-http") / "http.log")
    try:
        yield f
    finally:
        f.proc.send_signal(signal.SIGTERM)
        assert f.proc.wait(60) == 0, f.log_path.read_text()[-4000:]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"README.md:{b.line}")
def test_readme_python_block_runs_as_written(block: Block, live: RunningBroker, request: pytest.FixtureRequest
                                             ) -> None:
    code = block.code
    if block.needs == "http":
        front: Front = request.getfixturevalue("http")
        assert README_HTTP in code, f"README.md:{block.line} needs http but does not name {README_HTTP}"
        code = code.replace(README_HTTP, f"localhost:{front.port}")
    else:
        assert block.needs is None, f"README.md:{block.line}: needs {block.needs!r} is not started here"
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(live.runtime_dir))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, f"README.md:{block.line} exited {r.returncode}:\n{r.stderr[-4000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert r.stdout.strip(), f"README.md:{block.line} printed nothing"  # every block prints its results
