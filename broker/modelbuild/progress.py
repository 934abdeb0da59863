"""Progress bars of the offline tools, on stderr so that stdout keeps only the figures."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

stderr = Console(stderr=True)


@contextlib.contextmanager
def bar(label: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar for ``label`` (``total`` None: no known end); yields ``advance(n)``."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)
