"""The threads a parallel step runs on, from what other processes use of this process's cores
(inferd/models/cores.py): the rule as a table, the measurement on injected readings, and the signal itself
beside a real busy process."""
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from inferd.models.cores import CoreShare, Monitor, Sample, allowed_cpus, others_cores, threads_for


@pytest.mark.parametrize("cores, others, current, most, expected", [
    (2, 0.0, 2, 2, 2),  # alone
    (2, 0.05, 1, 2, 2),  # the gateway's and a light client's bursts: back to every core
    (2, 1.0, 2, 2, 1),  # a busy process: one thread, on the core it leaves
    (2, 0.7, 2, 2, 1),  # what a busy process gets beside two threads that spin
    (2, 0.4, 2, 2, 2),  # in the band: stays
    (2, 0.4, 1, 2, 1),  # in the band: stays
    (2, 0.5, 2, 2, 1),
    (2, 0.3, 1, 2, 2),
    (2, 1.9, 2, 2, 1),  # never fewer than one
    (2, 0.0, 1, 1, 1),  # never more than asked
    (16, 3.0, 16, 16, 13),
    (16, 0.0, 4, 8, 8),
])
def test_threads_follow_the_free_cores(cores, others, current, most, expected):
    assert threads_for(cores, others, current, most) == expected


@dataclass
class Signal:
    """An injected Monitor: what others used of `cpus` in the last two windows, and how many were measured."""
    cpus: list[int]
    last_two: tuple[float, float] = (0.0, 0.0)
    windows: int = 0

    @property
    def others_cores(self) -> float:
        return self.last_two[1]

    def measured(self, others_cores: float) -> None:
        self.last_two, self.windows = (self.last_two[1], others_cores), self.windows + 1


def test_a_thread_goes_after_two_windows_and_comes_back_after_one():
    signal = Signal([0, 1])
    share = CoreShare(2, signal)
    assert share.threads() == 2
    signal.measured(0.7)  # what a busy process gets beside two threads that spin: one window is not enough
    assert share.threads() == 2 and share.num_changes == 0
    signal.measured(0.8)
    assert share.threads() == 1 and share.num_changes == 1
    signal.last_two = (0.0, 0.0)  # not a new window: nothing is decided
    assert share.threads() == 1
    signal.measured(0.05)  # one quiet window gives it back
    assert share.threads() == 2 and share.num_changes == 2


def test_after_an_idle_spell_the_last_window_decides():
    """No step asked while a neighbour came and went: the count decided before is stale, the last window says."""
    signal = Signal([0, 1])
    share = CoreShare(2, signal)
    signal.measured(0.9)
    signal.measured(0.9)
    assert share.threads() == 1
    for others in (0.9, 0.9, 0.8, 0.05):  # idle: no step asks
        signal.measured(others)
    assert share.threads() == 2


def test_a_spike_of_one_window_keeps_the_threads():
    """A burst of arrivals templated in the gateway, or a client starting, busy for one window only."""
    signal = Signal([0, 1])
    share = CoreShare(2, signal)
    for others in (0.05, 0.6, 0.1, 0.9, 0.05, 0.05):
        signal.measured(others)
        assert share.threads() == 2
    assert share.num_changes == 0


def test_two_windows_down_to_different_counts_take_the_smaller_step():
    signal = Signal(list(range(16)))
    share = CoreShare(16, signal)
    signal.measured(5.0)
    signal.measured(3.0)
    assert share.threads() == 13


def test_a_fixed_share_stays():
    share = CoreShare.of_this_process(2, adapt=False)
    assert share.threads() == 2 and share.others_cores == 0.0


def test_others_are_the_busy_time_less_this_process():
    assert others_cores(Sample(0, 0, 0), Sample(1.0, 1.6, 0.9)) == pytest.approx(0.7)
    assert others_cores(Sample(0, 0, 0), Sample(2.0, 0.1, 0.3)) == 0.0  # ticks lag the process clock


def test_a_busy_process_shows_as_others():
    """The signal on this machine: a process that spins is counted as others' work while this one sleeps, by
    the monitor's own thread, and a share of all the cores goes down a thread."""
    cpus = allowed_cpus()
    watch = Monitor(cpus, window_s=0.25)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        share = CoreShare(len(cpus), watch)
        time.sleep(0.3)
        start = watch.windows
        deadline = time.monotonic() + 10
        while watch.windows < start + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.others_cores >= 0.5
        if len(cpus) == 2:
            assert share.threads() == 1
    finally:
        busy.kill()
        busy.wait()
