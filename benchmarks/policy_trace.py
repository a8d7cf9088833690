"""The demo policy's forward pass traced to TorchScript (what PolicyFiles.predict runs) against the network's
eager modules, alone and beside a thread that spins in Python (as the gateway's event loop does when the policy
runs in its process): the eager forward takes the GIL back between every op, so beside such a thread each op
waits for a switch interval.

    PYTHONPATH=. .venv/bin/python benchmarks/policy_trace.py --out benchmarks/results/policy-trace.json
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.policy import machine  # noqa: E402
from inferd.policy.runtime import PolicyRuntime  # noqa: E402
from inferd.policy.sim import ReacherTask  # noqa: E402
from inferd.protocol.policy import check_observation  # noqa: E402


def ms_per_forward(net, inputs, seconds: float, beside_python: bool) -> float:
    stop = False

    def spin():
        x = 0
        while not stop:
            x += 1

    spinner = threading.Thread(target=spin) if beside_python else None
    if spinner:
        spinner.start()
    n, end = 0, time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < end:
            net(*inputs)
            n += 1
    stop = True
    if spinner:
        spinner.join()
    return seconds / n * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.setswitchinterval(0.0005)  # as `inferd serve`'s gateway runs
    runtime = PolicyRuntime.load(None)  # one torch thread, as served
    obs = check_observation(runtime.spec, ReacherTask(0).observation()).values
    inputs = runtime.files.batch([obs] * args.batch)
    nets = {"traced": runtime.files.forward, "eager": runtime.files.network}
    cells = {(name, beside): [] for name in nets for beside in (False, True)}
    for _ in range(args.rounds):  # the variants take turns
        for (name, beside), times in cells.items():
            times.append(ms_per_forward(nets[name], inputs, args.seconds, beside))
    med = {f"{name}_{'beside_python' if beside else 'alone'}_ms": round(statistics.median(t), 3)
           for (name, beside), t in cells.items()}
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "batch": args.batch, "rounds": args.rounds,
              "median_ms_per_forward": med,
              "eager_over_traced": {"alone": round(med["eager_alone_ms"] / med["traced_alone_ms"], 2),
                                    "beside_python": round(med["eager_beside_python_ms"]
                                                           / med["traced_beside_python_ms"], 2)}}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
