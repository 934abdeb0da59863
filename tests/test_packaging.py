"""The package layout: pyproject.toml lists every package folder, so that a build from a copy of the checkout
that lost its links fails instead of making a wheel without code, and such a copy refuses to import. shmbroker/ray
is the one package folder inside shmbroker/ (a top-level ray/ would shadow Ray itself)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO


def test_the_listed_packages_are_the_package_folders() -> None:
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(listed) == sorted(_packages())


def _packages() -> list[str]:
    out = ["shmbroker"]
    for link in sorted((REPO / "shmbroker").iterdir()):
        if not (link.is_dir() and (link / "__init__.py").is_file()):
            continue
        for init in link.rglob("__init__.py"):
            rel = init.parent.relative_to(link)
            out.append(".".join(("shmbroker", link.name, *rel.parts)))
    return out


def test_ray_is_an_extra_and_shmbroker_ray_its_own_folder() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("ray") for d in project["dependencies"])
    assert [d for d in project["optional-dependencies"]["ray"] if d.startswith("ray[serve]")]
    ray_dir = REPO / "shmbroker" / "ray"
    assert ray_dir.is_dir() and not ray_dir.is_symlink() and not (REPO / "ray").exists()


def test_a_copy_without_the_links_neither_imports_nor_builds(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "shmbroker", copy / "shmbroker", symlinks=True)
    for link in (copy / "shmbroker").iterdir():
        if link.is_symlink():
            link.unlink()
    shutil.copy(REPO / "pyproject.toml", copy)
    shutil.copy(REPO / "README.md", copy)
    imported = subprocess.run([sys.executable, "-c", "import shmbroker"], cwd=copy, capture_output=True, text=True,
                              check=False)
    assert imported.returncode != 0 and "lacks its links to the role folders" in imported.stderr, imported.stderr
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                            str(tmp_path / "dist"), str(copy)], capture_output=True, text=True, check=False)
    assert built.returncode != 0, built.stdout
    assert "shmbroker/bench" in built.stdout + built.stderr  # names the first missing folder
    assert not list((tmp_path / "dist").glob("*.whl"))
