"""The threads a parallel step runs on, from what other processes use of this process's cores
(inferd/models/cores.py): the rule as a table, the measurement on injected readings, and the signal itself
beside a real busy process."""
import subprocess
import sys
import time

import pytest

from inferd.models.cores import CoreShare, Sample, allowed_cpus, sample, threads_for


@pytest.mark.parametrize("cores, others, current, most, expected", [
    (2, 0.0, 2, 2, 2),  # alone
    (2, 0.05, 1, 2, 2),  # the gateway's and a light client's bursts: back to every core
    (2, 1.0, 2, 2, 1),  # a busy process: one thread, on the core it leaves
    (2, 0.7, 2, 2, 1),  # what a busy process gets beside two threads that spin
    (2, 0.3, 2, 2, 2),  # in the band: stays
    (2, 0.3, 1, 2, 1),  # in the band: stays
    (2, 0.4, 2, 2, 1),
    (2, 0.2, 1, 2, 2),
    (2, 1.9, 2, 2, 1),  # never fewer than one
    (2, 0.0, 1, 1, 1),  # never more than asked
    (16, 3.0, 16, 16, 13),
    (16, 0.0, 4, 8, 8),
])
def test_threads_follow_the_free_cores(cores, others, current, most, expected):
    assert threads_for(cores, others, current, most) == expected


def readings(*steps: tuple[float, float, float]):
    """A read function that returns (wall, busy, own) seconds in turn."""
    it = iter(steps)
    return lambda cpus: Sample(*next(it))


def test_others_are_the_busy_time_less_this_process():
    share = CoreShare(2, cpus=[0, 1], read=readings((0, 0, 0)))
    share.observe(Sample(1.0, 1.6, 0.9))  # the cores were busy 1.6 s of which 0.9 s were ours
    assert share.others_cores == pytest.approx(0.7)
    assert share.current == 1 and share.num_changes == 1
    share.observe(Sample(2.0, 2.6, 1.85))  # others used 0.05 of a core: all cores again
    assert share.others_cores == pytest.approx(0.05)
    assert share.current == 2 and share.num_changes == 2


def test_a_fixed_share_never_reads():
    share = CoreShare(2, cpus=[0, 1], adapt=False, read=lambda cpus: pytest.fail("read"))
    assert share.threads() == 2


def test_it_measures_once_a_window():
    calls = []

    def read(cpus):
        calls.append(time.monotonic())
        return Sample(time.monotonic(), 0.0, 0.0)
    share = CoreShare(2, cpus=[0, 1], read=read, window_s=0.05)
    for _ in range(1000):
        share.threads()
    time.sleep(0.06)
    share.threads()
    assert len(calls) == 2  # at start and once the window passed


def test_a_busy_process_shows_as_others():
    """The signal on this machine: a process that spins on one of our cores is counted as others' work, while
    this process sleeps."""
    cpus = allowed_cpus()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = sample(cpus)
        time.sleep(1.0)
        after = sample(cpus)
    finally:
        busy.kill()
        busy.wait()
    share = CoreShare(len(cpus), cpus=cpus, read=lambda c: before)
    share.observe(after)
    assert share.others_cores >= 0.5
    if len(cpus) == 2:
        assert share.current == 1
