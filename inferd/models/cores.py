"""The cores this process gets: those its CPU affinity allows, less what other processes used of them lately.

A parallel loop runs as fast as its slowest thread. When another process takes one of the cores, the thread
there waits for its time slice at every loop's end, and a step of a few hundred loops takes 10-100x its time;
on fewer threads than cores the same step keeps its speed. So a step runs on the cores that are free:

    others_cores = (busy time of the allowed cores - this process's own CPU time) / wall time, over a window

The busy time is /proc/stat's (user, nice, system, irq, softirq and steal: what a VM's host gave to others);
this process's own is its CPU clock, so its threads' spinning and its HTTP loop never count as others'. The
threads follow `cores - others_cores` with a dead band (threads_for), so they do not flap at its edge. A thread
goes only when two windows in a row say so, since one window's spike (a burst of arrivals templated in the gateway,
a client starting) would take it for the next window; it comes back after one quiet window, the last measured
(after an idle spell too, where the count decided before it is stale).
"""
import math
import os
import threading
import time
from dataclasses import dataclass

WINDOW_S = 0.5  # how often others' use is measured (a read of /proc/stat: tens of microseconds)
# A thread more than the free cores' count pays while others use at most BEARABLE of the core it shares (2 threads
# over 1 crosses 1.0 between 0.3 and 0.5 of a core at 1-32 streams on an AVX2 EPYC,
# benchmarks/results/threads-beside-zen3-avx2.md, and between 0.4 and 0.5 at 1 and 8 on an AMX Xeon,
# threads-beside-amx.md); the band of +-BAND around it keeps the count from flapping at its edge.
BEARABLE, BAND = 0.4, 0.05
_BUSY = (0, 1, 2, 5, 6, 7)  # /proc/stat cpuN's user nice system [idle iowait] irq softirq steal
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity, which the control plane sets: control/cpus.py)."""
    return sorted(os.sched_getaffinity(0))


def busy_seconds(cpus: list[int]) -> float | None:
    """The busy time of these cores since boot, from /proc/stat; None where it cannot be read."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    ticks = sum(int(fields[1 + i]) for fields in lines if fields[0] in wanted for i in _BUSY if 1 + i < len(fields))
    return ticks * _TICK_S


@dataclass(slots=True)
class Sample:
    wall_s: float
    busy_s: float  # the allowed cores' busy time (all processes)
    own_s: float  # this process's CPU time


def sample(cpus: list[int]) -> Sample | None:
    busy = busy_seconds(cpus)
    return None if busy is None else Sample(time.monotonic(), busy, time.process_time())


def others_cores(before: Sample, now: Sample) -> float:
    """The cores other processes used between two samples."""
    wall = now.wall_s - before.wall_s
    return max(0.0, (now.busy_s - before.busy_s) - (now.own_s - before.own_s)) / wall if wall > 0 else 0.0


class Monitor:
    """What other processes use of a set of cores, measured every window by a thread of its own (so that the
    figure is fresh when a step starts after an idle spell). One a process per set of cores: monitor()."""

    def __init__(self, cpus: list[int], window_s: float = WINDOW_S):
        self.cpus, self.window_s = cpus, window_s
        self.last_two = (0.0, 0.0)  # others' use in the window before the last and in the last
        self.windows = 0  # windows measured so far: a reader sees a new figure when this moves
        threading.Thread(target=self._run, name="inferd-cores", daemon=True).start()

    @property
    def others_cores(self) -> float:
        return self.last_two[1]

    def _run(self) -> None:
        last = sample(self.cpus)
        while last is not None:
            time.sleep(self.window_s)
            if (now := sample(self.cpus)) is None:
                return
            self.last_two, last = (self.last_two[1], others_cores(last, now)), now
            self.windows += 1


_monitors: dict[tuple[int, ...], Monitor] = {}
_monitors_lock = threading.Lock()


def monitor(cpus: list[int]) -> Monitor:
    with _monitors_lock:
        if (m := _monitors.get(tuple(cpus))) is None:
            m = _monitors[tuple(cpus)] = Monitor(cpus)
        return m


class CoreShare:
    """How many threads a parallel step should run on now: at most `most`, fewer while other processes use the
    allowed cores (a Monitor's figure, or None: always `most`). `threads()` is cheap to call every step."""

    def __init__(self, most: int, source: Monitor | None = None):
        self.most = max(1, most)
        self.cores = len(source.cpus) if source is not None else self.most
        self.current = self.most
        self.num_changes = 0
        self._source, self._seen = source, 0

    @classmethod
    def of_this_process(cls, most: int, adapt: bool = True) -> "CoreShare":
        return cls(most, monitor(allowed_cpus()) if adapt else None)

    @property
    def others_cores(self) -> float:
        return self._source.others_cores if self._source is not None else 0.0

    def threads(self) -> int:
        if self._source is not None and self._source.windows != self._seen:
            self._seen = self._source.windows
            before, last = (threads_for(self.cores, o, self.current, self.most) for o in self._source.last_two)
            if last > self.current:  # one quiet window gives threads back
                chosen = last
            elif max(before, last) < self.current:  # two busy windows in a row take them, the smaller step
                chosen = max(before, last)
            else:
                chosen = self.current
            if chosen != self.current:
                self.current, self.num_changes = chosen, self.num_changes + 1
        return self.current


def threads_for(cores: int, others_cores: float, current: int, most: int) -> int:
    """The threads for `cores` allowed cores of which others use `others_cores`, coming from `current`: down
    once others take more than BEARABLE + BAND of the last thread's core, up once less than BEARABLE - BAND."""
    free = cores - others_cores
    if (down := math.floor(free + BEARABLE + BAND)) < current:
        current = down
    elif (up := math.floor(free + BEARABLE - BAND)) > current:
        current = up
    return max(1, min(most, current))
