"""The machine a result was taken on, written into every result: the figures are only comparable with their peers
measured on the same machine, in the same run (the machine a session gets changes)."""
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().strip()
    except OSError:
        return ""


def describe() -> dict:
    """CPU model, family and the kernels' variant it runs, cores, memory, versions, commit and date."""
    from inferd.kernels import variants

    def cpuinfo(field: str) -> str:
        try:
            return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith(field))
        except (OSError, StopIteration):
            return ""
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        memory_gib = None
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    import torch
    return {"cpu": cpu_name(), "family": cpuinfo("cpu family"), "model": cpuinfo("model\t"),
            "kernels": variants.best() or "none (torch's ops)", "cores": os.cpu_count(),
            "allowed_cpus": len(os.sched_getaffinity(0)), "memory_gib": memory_gib,
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": loadavg(),
            "argv": " ".join(sys.argv)}
