"""Two source trees of inferd served the same way, measured with one client: `inferd serve` (SmolLM2-135M, one
replica) started from each tree in turn, then `inferd bench run` from this one with the README's workload
(chat, 256 in / 64 out, streamed) at fixed Poisson rates. The trees take turns at every rate and repeat, so a
change of the machine's speed falls on both; each figure is the median of the repeats.

    git worktree add ../inferd-before <commit>
    PYTHONPATH=. .venv/bin/python benchmarks/served_ab.py --tree before=../inferd-before --tree after=. \\
        --rates 0.4,0.7 --out benchmarks/results/served-ab.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.embeddings import ROOT, started_server, stopped
from benchmarks.machine import cpu_name
from benchmarks.runtimes import default_model, figures, medians

KEY = "sk-served-ab"


def bench_rate(url: str, rate: float, seconds: float, out: Path, seed: int) -> dict:
    cmd = [sys.executable, "-m", "inferd.cli", "bench", "run", "--arrival", "poisson", "--rate", str(rate),
           "--duration-s", str(seconds), "--base-url", url, "--api-key", KEY, "--tokenizer", str(default_model()),
           "--input-tokens", "256", "--output-tokens", "64", "--warmup-requests", "2",
           "--slo", "ttft_ms=3000,tpot_ms=300", "--seed", str(seed), "--out", str(out), "--no-html",
           "--no-progress", "--log-level", "warning"]
    code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
    if code not in (0, 3):
        raise RuntimeError(f"inferd bench exited with {code}")
    report = json.loads(out.with_name(out.name + ".json").read_text()) | {"client_lagged": code == 3}
    return figures(report) | {"goodput_per_s": report["summary"]["goodput"]["goodput_per_s"]}


def served(tree: Path, port: int, work: Path, replica_args: list[str], extensions: Path) -> subprocess.Popen:
    """inferd serve from tree, its C++ kernels built in the folder extensions (one a tree: taking turns does not
    rebuild them)."""
    command = [sys.executable, "-m", "inferd.cli", "serve", "--port", str(port), "--api-key", KEY,
               "--db", f"sqlite:///{work / 'inferd.db'}", "--usage-journal", str(work / "usage.journal"),
               "--files-dir", str(work / "files"), "--log-level", "warning", str(default_model()),
               "--embedding-model", "none", "--classical-model", "none", "--policy-model", "none", *replica_args]
    env = {"PYTHONPATH": str(tree.resolve()), "TORCH_EXTENSIONS_DIR": str(extensions)}
    return started_server(command, f"http://127.0.0.1:{port}/ready", env, f"inferd-served-ab-{tree.name}", 300,
                          cwd=tree.resolve())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="LABEL=PATH of an inferd source tree")
    p.add_argument("--rates", default="0.4,0.7", help="requests per second")
    p.add_argument("--seconds", type=float, default=60.0, help="per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--replica-args", default="", help="more arguments of inferd serve, for every tree")
    p.add_argument("--port", type=int, default=8975)
    p.add_argument("--machine-note", default="nothing else running")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "served-ab.json")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rates = [float(r) for r in args.rates.split(",")]
    runs: dict[str, dict[str, list]] = {label: {str(r): [] for r in rates} for label in trees}
    commits = {label: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() for label, path in trees.items()}
    with tempfile.TemporaryDirectory(prefix="inferd-served-ab-") as tmp:
        for i in range(args.repeats):
            for rate in rates:
                for label, path in trees.items():  # taking turns
                    work = Path(tmp) / f"{label}-{rate}-{i}"
                    work.mkdir()
                    proc = served(Path(path), args.port, work, args.replica_args.split(),
                                  Path(tmp) / "extensions" / label)
                    try:
                        row = bench_rate(f"http://127.0.0.1:{args.port}", rate, args.seconds, work / "bench", i)
                    finally:
                        stopped(proc)
                    runs[label][str(rate)].append(row)
                    print(json.dumps({"tree": label, "rate": rate, "repeat": i, **row}), flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                          "note": args.machine_note},
              "trees": commits,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "tree")},
              "runs": runs,
              "medians": {label: {r: medians(rows) for r, rows in by_rate.items()} for label, by_rate in runs.items()}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    labels = list(r["trees"])
    lines = [f"# Served A/B (`benchmarks/served_ab.py`, {r['date']})", "",
             f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores ({r['machine']['note']}). `inferd serve` "
             "(SmolLM2-135M, one replica), `inferd bench run`: chat 256 in / 64 out, Poisson arrivals, "
             f"{r['settings']['seconds']:g} s per run, medians of {r['settings']['repeats']} runs taking turns. "
             "Trees: " + ", ".join(f"{k} = {v}" for k, v in r["trees"].items()) + ".", "",
             "| rate req/s | tree | output tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms | goodput req/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rate in r["medians"][labels[0]]:
        for label in labels:
            m = r["medians"][label][rate]
            lines.append(f"| {rate} | {label} | {m['output_tok_s']:.1f} | {m['ttft_p50_ms']:.0f} | "
                         f"{m['ttft_p95_ms']:.0f} | {m['tpot_p50_ms']:.1f} | {m['tpot_p95_ms']:.1f} | "
                         f"{m['goodput_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
