"""A replica's model is loaded in a thread that exits, so that the one thread that runs it owns torch's OpenMP pool.

libgomp, torch's OpenMP, keeps a pool of worker threads for every thread that has run a parallel region, until
that thread exits, and counts them all. Once a process has more of them than CPUs, a worker that finishes a
parallel region stops spinning for the next one and sleeps at once, and every op pays for waking it. A model
loaded on the main thread and run on another (the engine's thread, the batcher's worker) leaves two pools: on
2 cores one bf16 linear of SmolLM2's at 8 rows took 137 µs in the second thread against 58 µs with one pool, and
59 µs with its weights made here (benchmarks/openmp_pools.py, Sapphire Rapids).
"""
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() run in a thread of its own, which has exited (and its OpenMP pool with it) when this returns;
    fn's exception, if any, is raised here."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="inferd-load", daemon=True)  # daemon: Ctrl-C during a load exits
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
