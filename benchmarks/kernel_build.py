"""How long the C++ kernels take to build: this tree's inferd/kernels/csrc against another revision's, each
from an empty build directory, with the flags inferd/kernels/build.py uses (torch's cpp_extension, ninja,
MAX_JOBS = the CPUs), in turn.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_build.py --baseline 8359a39 --out benchmarks/results/kernel-build.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from inferd.kernels.build import SOURCES  # noqa: E402


def sources_of(rev: str | None, into: Path) -> list[str]:
    """The csrc files of rev (None: this tree) copied into `into`; the build's sources among them."""
    into.mkdir(parents=True)
    if rev is None:
        names = [p.name for p in (ROOT / "inferd/kernels/csrc").iterdir()]
        for name in names:
            (into / name).write_bytes((ROOT / "inferd/kernels/csrc" / name).read_bytes())
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "inferd/kernels/csrc/"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        for path in names:
            blob = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
            (into / Path(path).name).write_bytes(blob)
    return [str(into / s) for s in SOURCES if (into / s).exists()]


def build_seconds(sources: list[str], build_dir: Path, name: str) -> float:
    from torch.utils.cpp_extension import load
    build_dir.mkdir(parents=True)
    started = time.perf_counter()
    load(name=name, sources=sources, extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True, help="a git revision with inferd/kernels/csrc")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    times: dict[str, list[float]] = {"this tree": [], args.baseline: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, rev in (("this tree", None), (args.baseline, args.baseline)):
                work = Path(tmp) / f"{r}-{label.replace(' ', '_')}"
                # each in a process of its own: cpp_extension.load imports the module it built
                code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.kernel_build import *; "
                        f"print(build_seconds(sources_of({rev!r}, Path({str(work / 'src')!r})), "
                        f"Path({str(work / 'build')!r}), 'kb_{r}_{abs(hash(label)) % 10**6}'))")
                out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                times[label].append(round(float(out.stdout.split()[-1]), 1))
                print(label, times[label][-1], "s", flush=True)
    result = {"machine": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "build_seconds": times}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
