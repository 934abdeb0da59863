"""Sum py-spy's collapsed stacks (``--format raw``) by thread and by function: where a process spends its CPU.

``python -m shmbroker.bench.folded FILE [--top N]``: per thread, its share of the samples; then the functions with the
most samples inclusive (anywhere on the stack) and exclusive (on top), each as a share of all samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::(?P<line>\d+))?\)$")


def parse(text: str) -> list[tuple[list[str], int]]:
    """(frames root first, sample count) per line; a line is ``frame;frame;... count``."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _name(frame: str) -> str:
    """``func (path/file.py:12)`` as ``file.py:func``; other frames (threads, native) unchanged."""
    m = FRAME.match(frame)
    return f"{Path(m['file']).name}:{m['func']}" if m else frame


def summarize(stacks: list[tuple[list[str], int]], top: int) -> str:
    total = sum(c for _, c in stacks) or 1
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    exclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        threads[frames[0] if frames else "?"] += count
        names = [_name(f) for f in frames[1:]]
        for name in set(names):
            inclusive[name] += count
        if names:
            exclusive[names[-1]] += count
    lines = [f"{total} samples"]
    lines += [f"  {100 * c / total:5.1f}%  {t}" for t, c in threads.most_common()]
    for title, counter in (("inclusive", inclusive), ("exclusive", exclusive)):
        lines.append(f"top {top} {title}")
        lines += [f"  {100 * c / total:5.1f}%  {n}" for n, c in counter.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.folded", description=__doc__)
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    sys.stdout.write(summarize(parse(Path(args.file).read_text()), args.top) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
