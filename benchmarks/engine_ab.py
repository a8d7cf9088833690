"""One engine change on and off: decode tok/s of the same engine built both ways, in one run, in turn.

--change names what differs; "on" is the engine as it ships, "off" without the change:
  huge_page_weights  weights on 2 MiB pages (inferd/models/huge_pages.py) / on 4 KiB pages
  decode_loop        a decode step's layers as one C++ call (inferd/models/decode_loop.py) / the Python loop
  amx_many_rows      a prefill's rows of the narrower linears on amx_linear (select.DENSE_BF16's last row) /
                     all on oneDNN's prepacked product
For each of --formats (dtype:quantization) both engines are built in this process; each decode batch size is
measured on both in turn (benchmarks/engine.py's decode: B prompts of 128 random tokens, --new-tokens each,
greedy), the order swapped every round, so the machine's drift and the order hit both alike. With --prefill
(prompt lengths) the same for a prompt's prefill, one at a time, in chunks of 512 tokens as `inferd serve`
prefills them: prompt tokens/s. The read bandwidth
on both kinds of pages is measured after every round (limits.py): on some VMs it swings between two levels
within minutes, and a memory-bound gain with it.

    PYTHONPATH=. .venv/bin/python benchmarks/engine_ab.py --change decode_loop \
        --out benchmarks/results/decode-loop-ab.json
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import torch

from benchmarks import limits
from benchmarks.engine import NEW_TOKENS, PROMPT_LEN, _log, inferd_decode, random_prompts
from benchmarks.machine import cpu_name, loadavg
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.kernels import select
from inferd.models.loader import load_model

CHANGES = ("huge_page_weights", "decode_loop", "amx_many_rows")
PREFILL_CHUNK = 512  # EngineConfig's max_num_batched_tokens, as inferd serve runs


def engine(model, spec: str, change: str, on: bool, batches: list[int], prefill: bool) -> LLMEngine:
    dtype, quantization = (spec.split(":") + [""])[:2]
    settings = {"huge_page_weights": on} if change == "huge_page_weights" else {}
    e = LLMEngine(model, EngineConfig(dtype=dtype, quantization=quantization or "none",
                                      max_num_seqs=max(batches),
                                      max_num_batched_tokens=PREFILL_CHUNK if prefill else max(batches) * PROMPT_LEN,
                                      kv_cache_gib=1.0, enable_prefix_caching=False,
                                      small_step_threads=torch.get_num_threads(), **settings))
    if change == "decode_loop" and not on:
        e.runner.model._loop = lambda meta, rows: None
    if change == "amx_many_rows":  # the layers' ops are bound on first use: now, with the limit of this side
        rules = select.DENSE_BF16
        select.DENSE_BF16 = rules if on else rules[:-1]
        e.runner.model.layer_ops()
        select.DENSE_BF16 = rules
    return e


def prefill_tok_s(e: LLMEngine, length: int, seed: int) -> float:
    (ids,) = random_prompts(1, length, e.model.config.vocab_size, seed=seed)
    e.add_request(f"p{length}-{seed}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while e.has_work():
        e.step()
    return length / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--change", choices=CHANGES, required=True)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: packaged SmolLM2)")
    ap.add_argument("--formats", default="auto:none,auto:int4")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens each sequence decodes: the context "
                    "attention reads grows to 128 + this")
    ap.add_argument("--prefill", default=None, help="prompt lengths: measure prefill instead of decode")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prefills = [int(n) for n in args.prefill.split(",")] if args.prefill else []
    model = load_model(args.model, progress=False)
    reads = []
    result = {"change": args.change, "new_tokens": args.new_tokens, "prefill": bool(prefills),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                          "load_average_before": loadavg()},
              "formats": {}}
    for spec in args.formats.split(","):
        engines = {"on": engine(model, spec, args.change, True, batches, bool(prefills)),
                   "off": engine(model, spec, args.change, False, batches, bool(prefills))}
        label = str(engines["on"].dtype).removeprefix("torch.") + f" {engines['on'].quantization}"
        rows = {}
        for b in prefills or batches:
            key = f"prefill {b}" if prefills else b
            if prefills:
                for e in engines.values():  # warm: a first prompt builds what later ones reuse
                    prefill_tok_s(e, b, seed=10_000)
            runs = {"on": [], "off": []}
            for round_ in range(args.repeats):
                for name in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                    runs[name].append(prefill_tok_s(engines[name], b, round_) if prefills
                                      else inferd_decode(engines[name], b, args.new_tokens))
                    _log(f"{label} {'prefill' if prefills else 'B='}{b} {name}: {runs[name][-1]:.1f} tok/s")
                reads.append({"4k": limits.read_bandwidth() / 1e9, "2m": limits.read_bandwidth(huge_pages=True) / 1e9})
            on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
            rows[str(key)] = {"on_tok_s": runs["on"], "off_tok_s": runs["off"], "on_median": round(on, 1),
                            "off_median": round(off, 1), "ratio": round(on / off, 3),
                            "round_ratios": [round(a / b, 3) for a, b in zip(runs["on"], runs["off"])]}
        result["formats"][label] = rows
        del engines
    result["read_bandwidth_gb_s"] = {k: {"median": round(statistics.median(r[k] for r in reads), 1),
                                         "runs": [round(r[k], 1) for r in reads]} for k in ("4k", "2m")}
    result["machine"]["load_average_after"] = loadavg()
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def table(r: dict) -> str:
    bw, m = r["read_bandwidth_gb_s"], r["machine"]
    what = (f"prompts prefilled in chunks of {PREFILL_CHUNK}" if r.get("prefill")
            else f"{r.get('new_tokens', NEW_TOKENS)} new tokens a sequence")
    lines = [f"{r['change']} on/off, {what}; {m['cpu']}, {m['threads']} threads, {m['date']}; read bandwidth median 4 KiB "
             f"pages {bw['4k']['median']} GB/s, 2 MiB pages {bw['2m']['median']} GB/s", "",
             "| format | B (or prompt) | on tok/s | off tok/s | on/off (medians) | per round |", "|---|---:|---:|---:|---:|---|"]
    for label, rows in r["formats"].items():
        for b, row in rows.items():
            lines.append(f"| {label} | {b} | {row['on_median']} | {row['off_median']} | {row['ratio']:.2f}x | "
                         f"{', '.join(f'{x:.2f}' for x in row['round_ratios'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
