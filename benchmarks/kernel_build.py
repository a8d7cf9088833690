"""How long the C++ kernels take to build: this tree's install build (setup.py, the variants of each --isas set:
INFERD_KERNEL_ISAS) against another revision's csrc built as that revision did, at run time for -march=native
(torch's cpp_extension.load), each from an empty build directory (ninja, MAX_JOBS = the CPUs), in turn.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_build.py --baseline 79d43a7 --isas host,all \
        --out benchmarks/results/kernel-build-variants.json
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
from inferd.kernels.variants import SOURCES  # noqa: E402


def sources_of(rev: str, into: Path) -> list[str]:
    """The csrc files of rev copied into `into`; the build's sources among them."""
    into.mkdir(parents=True)
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


def install_build_seconds(isas: str, work: Path) -> tuple[float, dict[str, int]]:
    """setup.py's build of the `isas` variants in a copy of this tree's files; the seconds and each module's bytes."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "setup.py", "pyproject.toml",
                            "inferd/kernels"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes((ROOT / name).read_bytes())
    started = time.perf_counter()
    subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], cwd=work, check=True,
                   env={**os.environ, "INFERD_KERNEL_ISAS": isas}, capture_output=True)
    seconds = time.perf_counter() - started
    return seconds, {p.name.split(".")[0]: p.stat().st_size for p in (work / "inferd/kernels").glob("_C_*.so")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True, help="a git revision with inferd/kernels/csrc")
    p.add_argument("--isas", default="host,all", help="this tree's variant sets (INFERD_KERNEL_ISAS), comma-separated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sets = args.isas.split(",")
    times: dict[str, list[float]] = {**{f"this tree, {isas}": [] for isas in sets}, args.baseline: []}
    sizes: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for isas in sets:
                work = Path(tmp) / f"{r}-{isas}"
                seconds, sizes[isas] = install_build_seconds(isas, work)
                times[f"this tree, {isas}"].append(round(seconds, 1))
                print(isas, times[f"this tree, {isas}"][-1], "s", sorted(sizes[isas]), flush=True)
            work, rev = Path(tmp) / f"{r}-baseline", args.baseline
            # in a process of its own: cpp_extension.load imports the module it built
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.kernel_build import *; "
                    f"print(build_seconds(sources_of({rev!r}, Path({str(work / 'src')!r})), "
                    f"Path({str(work / 'build')!r}), 'kb_{r}_{abs(hash(rev)) % 10**6}'))")
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
            times[rev].append(round(float(out.stdout.split()[-1]), 1))
            print(rev, times[rev][-1], "s", flush=True)
    result = {"machine": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "build_seconds": times, "module_bytes": sizes}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
