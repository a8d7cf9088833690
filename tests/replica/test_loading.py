import subprocess
import sys

import pytest

from inferd.replica.loading import in_passing_thread

# A process that counts its OS threads around torch parallel regions: one run in a passing thread, then one here.
COUNT = """
import os, time, torch
from inferd.replica.loading import in_passing_thread
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
in_passing_thread(lambda: float((torch.ones(1 << 22) * 2).sum()))
deadline = time.monotonic() + 5  # the exited thread's workers are told to go when it exits; they go a moment later
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
after_passing = threads()
float((torch.ones(1 << 22) * 2).sum())
print(before, after_passing, threads())
"""


def test_returns_what_fn_returns_and_raises_what_it_raises():
    assert in_passing_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad weights"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad weights")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_load_in_a_passing_thread_leaves_no_openmp_workers_behind():
    """The passing thread's OpenMP pool goes with it; one made on this thread stays (what the test could miss)."""
    out = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, check=True).stdout
    before, after_passing, after_main = map(int, out.split())
    assert after_passing == before
    assert after_main == before + 1  # the worker of this thread's pool, for 2 threads
