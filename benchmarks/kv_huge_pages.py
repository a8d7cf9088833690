"""Decode with the KV cache on 4 KiB pages against the same cache on 2 MiB pages (transparent huge pages asked
for with madvise), two engines taking turns in one run; benchmarks/engine.py's workload. Run twice on Zen 4 it
gave 0.99-1.07x, within the machine's noise, so the engine keeps plain torch.zeros.

    PYTHONPATH=. python benchmarks/kv_huge_pages.py --out benchmarks/results/kv-huge-pages-zen4.json
"""
import argparse
import ctypes
import json
import statistics
from datetime import datetime, timezone

import torch

from benchmarks.engine import _log, inferd_decode, inferd_engine
from benchmarks.machine import cpu_name
from inferd.models.loader import load_model


HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros, with Linux asked (before any page is touched) to back its whole 2 MiB pages with huge pages."""
    t = torch.empty(shape, dtype=dtype)
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return t.zero_()


def anon_huge_mb() -> float:
    """This process's memory on transparent huge pages, MB."""
    line = next(line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="auto:none")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = load_model(None, progress=False)
    engines, huge_mb = {}, {}
    for pages in ("4 KiB", "2 MiB"):
        label, engine = inferd_engine(model, args.format, batches)
        cache = engine.runner.kv_cache
        before = anon_huge_mb()
        new = zeros_on_huge_pages(tuple(cache.shape), cache.dtype) if pages == "2 MiB" else \
            torch.zeros(cache.shape, dtype=cache.dtype)  # both fresh: neither has had its pages reused
        engine.runner.kv_cache = new
        huge_mb[pages] = anon_huge_mb() - before  # what each cache got: the proof of its page size
        _log(f"{pages}: {cache.nbytes / 2**20:.0f} MiB cache, huge pages +{huge_mb[pages]:.0f} MB")
        engines[pages] = engine
    runs = {}
    for _ in range(args.repeats):
        for b in batches:
            for pages, engine in engines.items():
                runs.setdefault((pages, b), []).append(inferd_decode(engine, b))
                _log(f"{pages} B={b}: {runs[pages, b][-1]:.1f} tok/s")
    rows = [{"batch": b, **{pages: {"median_tok_s": round(statistics.median(runs[pages, b]), 1),
                                    "runs_tok_s": [round(x, 1) for x in runs[pages, b]]} for pages in engines},
             "ratio": round(statistics.median(runs["2 MiB", b]) / statistics.median(runs["4 KiB", b]), 3)}
            for b in batches]
    lines = ["| B | 4 KiB pages tok/s | 2 MiB pages tok/s | ratio |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['4 KiB']['median_tok_s']} | {r['2 MiB']['median_tok_s']} | {r['ratio']:.2f}x |"
              for r in rows]
    print("\n".join(lines))
    if args.out:
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "format": label,
                  "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "torch": torch.__version__},
                  "cache_mib": cache.nbytes / 2**20, "huge_pages_added_mb": huge_mb, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
