"""How many CPU threads the tiny-model paths use (the toy warm start, the demo): one, unless OMP_NUM_THREADS says.

A ~1M-parameter model gains under 2 times from a second thread on an idle machine (the addition warm start: about
0.12 s/step on 2 threads, 0.21 on 1), and loses far more on a busy one: torch's OpenMP threads spin at every barrier
waiting for a thread that another process has taken the core from, so with one other busy process on a 2-core machine
a warm-start step took 2.2-4.5 s on 2 threads against 0.27-0.42 s on 1 (docs/performance.md has the measurements).
One thread slows down by about the machine's share of busy cores, not 5-17 times. A user who knows the machine is
theirs sets OMP_NUM_THREADS (or --threads where a command has it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["cpu_threads", "default_cpu_threads", "limit_cpu_threads"]


def default_cpu_threads() -> int:
    """OMP_NUM_THREADS when it is set to a positive integer, else 1."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return 1


def limit_cpu_threads(threads: int | None = None) -> int:
    """Set torch's CPU threads to `threads` (default: `default_cpu_threads`) for the rest of the process; returns it.
    The CPU quick start and `exgrpo train` on a CPU call it, as the tiny builder and the demo do."""
    import torch

    n = max(1, threads if threads is not None else default_cpu_threads())
    torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def cpu_threads(threads: int | None = None) -> Iterator[int]:
    """`limit_cpu_threads` for the duration of a block (the toy warm start), then torch's thread count as it was."""
    import torch

    before = torch.get_num_threads()
    try:
        yield limit_cpu_threads(threads)
    finally:
        torch.set_num_threads(before)
