"""Progress bars of the offline tools, on stderr so that stdout keeps only the figures."""

from __future__ import annotations

import contextlib
import time
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


@contextlib.contextmanager
def stages(title: str, total: int) -> Iterator[Callable[[str], contextlib.AbstractContextManager[None]]]:
    """A bar over ``total`` stages with the current stage's name and the time elapsed, for builds whose steps
    take minutes each; yields ``stage(label)``, a context manager around one stage. A finished stage also
    prints one plain line with its duration, so a log that is not a terminal still shows the progress."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr) as progress:
        task = progress.add_task(title, total=total)

        @contextlib.contextmanager
        def stage(label: str) -> Iterator[None]:
            progress.update(task, description=f"{title}: {label}")
            t0 = time.monotonic()
            yield
            progress.console.print(f"{title}: {label}: {time.monotonic() - t0:.1f} s", highlight=False)
            progress.advance(task)

        yield stage
