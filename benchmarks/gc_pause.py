"""How long a full garbage collection stops the gateway's event loop, with and without gc.freeze().

Imports what `inferd serve`'s gateway process imports, then times gc.collect() over --repeats (the objects that
start-up made are all a full collection walks while the gateway idles), then the same after gc.freeze(), which
`inferd.control.gateway_setup.run_gateway` calls before it serves.

    PYTHONPATH=. .venv/bin/python benchmarks/gc_pause.py --out benchmarks/results/gc-pause.json
"""
import argparse
import gc
import importlib
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path


def collect_ms(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        out.append(round((time.perf_counter() - t) * 1000, 2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    for module in ("inferd.cli", "inferd.control.gateway_setup", "inferd.gateway.app"):  # the gateway's imports
        importlib.import_module(module)
    tracked = len(gc.get_objects())
    before = collect_ms(args.repeats)
    gc.freeze()
    after = collect_ms(args.repeats)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
              "objects_tracked": tracked, "full_collection_ms": before, "after_freeze_ms": after,
              "median_ms": {"before": statistics.median(before), "after_freeze": statistics.median(after)}}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
