"""A change without a switch (a kernel's inside) measured as two trees in turn: this checkout against --base.

--base (a git revision) is checked out into a temporary worktree. Each round runs the benchmark command once in
each tree, the order swapped every round, so the machine's drift hits both alike; each tree has its own C++ kernels: a
revision whose setup.py builds them (inferd/kernels/variants.py) gets this CPU's variants built into its worktree
first, an older one builds them at its first run into a folder of its own (TORCH_EXTENSIONS_DIR), so that turns do
not rebuild. The command is run with
PYTHONPATH at its tree and "{out}" replaced by a JSON file it must write (a path under .venv, which git ignores and
the worktree lacks, is this checkout's); --metric names the numbers to compare,
as dotted paths into that JSON. Prints (and with --out writes) every round's figures and the medians' ratio
new / base.

    PYTHONPATH=. .venv/bin/python benchmarks/trees_ab.py --base HEAD~1 --rounds 5 \\
        --metric batches.1.forward_ms.C++\\ loop --metric batches.1.python_loop_by_op.ops_ms.paged_decode \\
        -- .venv/bin/python benchmarks/decode_step.py --format auto:int4 --batches 1 --context 1024 --out {out}
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.machine import cpu_name, describe
from benchmarks.limits import isa_limits

ROOT = Path(__file__).resolve().parents[1]


def value(doc: dict, path: str):
    for key in path.split("."):
        doc = doc[key]
    return doc


def run(tree: Path, command: list[str], extensions: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCH_EXTENSIONS_DIR": str(extensions)}
    argv = [str(ROOT / a) if a.startswith(".venv") else a.replace("{out}", str(out)) for a in command]
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare this checkout against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--metric", action="append", required=True, help="dotted path into the command's JSON")
    ap.add_argument("--out", default=None)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command, with {out}")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="trees-ab-") as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "base"), base_rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            if (tmp / "base" / "inferd" / "kernels" / "variants.py").exists():
                subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], cwd=tmp / "base",
                               env={**os.environ, "INFERD_KERNEL_ISAS": "host"}, check=True, capture_output=True)
            trees = {"new": ROOT, "base": tmp / "base"}
            runs = {name: {m: [] for m in args.metric} for name in trees}
            for round_ in range(args.rounds):
                for name in ("new", "base") if round_ % 2 == 0 else ("base", "new"):
                    doc = run(trees[name], command, tmp / f"ext-{name}", tmp / f"{name}.json")
                    for m in args.metric:
                        runs[name][m].append(value(doc, m))
                    print(f"round {round_} {name}: {json.dumps({m: v[-1] for m, v in runs[name].items()})}",
                          file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "base")], cwd=ROOT, capture_output=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_name(), "machine": describe(),
              "cores": os.cpu_count(), "isa_limits": isa_limits(), "base": base_rev,
              "new": head_rev + (" + uncommitted changes" if dirty else ""),
              "command": shlex.join(command), "runs": runs,
              "medians": {m: {name: statistics.median(runs[name][m]) for name in trees} for m in args.metric}}
    for m, med in result["medians"].items():
        med["new_over_base"] = round(med["new"] / med["base"], 3)
    print(json.dumps(result["medians"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
