"""Sums up a py-spy `--format raw --threads` recording: the share of samples per thread and the hottest stacks.

    python -m tools.profiling.collapsed py-spy-mixed-gil.txt [--depth 4] [--top 25]

Each line of the file is `thread (tid);frame;frame;... count`. A `--gil` recording samples only
the thread holding the GIL, so its shares say who holds it; a plain one, who runs on a core.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_TID = re.compile(r"\s*\(\d+\)")
_WHERE = re.compile(r" \((?:[^()]*/)?([^/()]+)\)$")  # "f (path/to/mod.py:12)" -> "f (mod.py:12)"


def load(path: str) -> list[tuple[str, list[str], int]]:
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            thread, *frames = stack.split(";")
            rows.append((_TID.sub("", thread), [_WHERE.sub(r" (\1)", fr) for fr in frames], int(count)))
    return rows


def summary(rows: list[tuple[str, list[str], int]], depth: int = 3, top: int = 25) -> str:
    total = sum(n for _, _, n in rows) or 1
    threads: Counter[str] = Counter()
    leaves: Counter[tuple[str, str]] = Counter()
    for thread, frames, n in rows:
        threads[thread] += n
        leaves[(thread, " <- ".join(reversed(frames[-depth:])))] += n
    lines = [f"{total} samples"]
    lines += [f"{n / total:6.1%}  {thread}" for thread, n in threads.most_common()]
    lines.append(f"hottest stacks (innermost {depth} frames):")
    lines += [f"{n / total:6.1%}  [{thread}] {stack}" for (thread, stack), n in leaves.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(summary(load(args.path), args.depth, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
