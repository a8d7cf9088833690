"""Where the cores go while `inferd serve` decodes B streams: each process's and each thread's CPU time over a window.

Starts `inferd serve` as benchmarks/served_decode.py does (one bf16 deployment of SmolLM2), streams B completions of
--new-tokens tokens with served_decode's light client from this process, and reads /proc/<pid>/task/*/stat at two
moments inside the decode (--at seconds after the streams start, then --window later): the gateway's process, each
replica process and the client, in cores (CPU seconds over wall seconds), with their busiest threads. The engine's
thread and its OpenMP workers are the replica's busiest; what the others take is what the step shares its cores with.

    PYTHONPATH=. .venv/bin/python benchmarks/served_cpu.py --out benchmarks/results/served-cpu.json
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.engine import PROMPT_LEN, random_prompts
from benchmarks.machine import cpu_name
from benchmarks.served_decode import KEY, decode_window, deployment_name, start_serve, streams

VOCAB = 49152  # the served default model's (SmolLM2): random prompt tokens are drawn below it


def thread_ticks(pid: int) -> dict[str, int]:
    """Each thread's user + system clock ticks, by 'tid name' (the main thread marked: a replica's HTTP loop)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[f"{tid} {name}" + (" (main)" if int(tid) == pid else "")] = int(fields[11]) + int(fields[12])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="auto:none", help="dtype:quantization of the served deployment")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--at", type=float, default=3.0, help="seconds after the streams start: the window's start")
    ap.add_argument("--window", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = deployment_name(args.format)
    serve, url = start_serve(Path(tempfile.mkdtemp(prefix="served-cpu-")), [args.format])
    try:
        asyncio.run(streams(url, KEY, model, random_prompts(2, PROMPT_LEN, VOCAB, seed=9), 32, "light"))  # warm-up
        children = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True).stdout.split()
        pids = {"gateway": serve.pid, **{f"replica {c}": int(c) for c in children}, "client": os.getpid()}
        marks = []

        def sample() -> None:
            for wait in (args.at, args.window):
                time.sleep(wait)
                marks.append((time.perf_counter(), {name: thread_ticks(pid) for name, pid in pids.items()}))

        sampler = threading.Thread(target=sample)
        sampler.start()
        done = asyncio.run(streams(url, KEY, model, random_prompts(args.batch, PROMPT_LEN, VOCAB, seed=1),
                                   args.new_tokens, "light"))
        sampler.join()
    finally:
        serve.terminate()
        serve.wait()
    (t0, a), (t1, b) = marks
    if t1 > min(s["times"][-1] for s in done):
        print("warning: a stream ended inside the window: raise --new-tokens", file=sys.stderr)
    ticks = (t1 - t0) * os.sysconf("SC_CLK_TCK")
    processes = {}
    for name in pids:
        threads = {k: round((v - a[name].get(k, 0)) / ticks, 3) for k, v in b[name].items()}
        busiest = dict(sorted(((k, v) for k, v in threads.items() if v >= 0.005), key=lambda kv: -kv[1]))
        processes[name] = {"cores": round(sum(threads.values()), 3), "threads": busiest}
    result = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "format": args.format, "batch": args.batch,
              "new_tokens": args.new_tokens, "window_s": args.window, "decode_tok_s": round(decode_window(done), 1),
              "processes": processes}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
