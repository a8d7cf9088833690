"""Speculative decoding: decode speed with k drafts per step against none, per workload and draft source.

Workloads (SmolLM2-135M-Instruct, chat template, greedy, fp32, 128 new tokens):
- copy: the answer quotes given excerpts ("repeat the excerpt word for word"), where drafts hit;
- free: open generation (a story), where the model rarely repeats itself.
Draft sources (--draft, comma-separated): lookup (prompt lookup), layers:N (a self-speculative layer-skip
draft: the model's own first N of its 30 layers, its final norm and lm_head; no smaller model of SmolLM2's
tokenizer ships here), or the path of a draft model of the same tokenizer.
Reported per draft, k and batch size (1 and 8): decode tokens/s (all tokens after the first, over the time of
the steps that made them, drafting included), the speedup over k = 0, and the acceptance rate by draft position.

    python benchmarks/spec_decode.py --out benchmarks/results/spec_decode.json
    python benchmarks/spec_decode.py --draft lookup,layers:8,layers:15 --ks 0,2,4 --out ...
"""
import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

EXCERPTS = [
    "The committee met on Tuesday and agreed that the bridge repairs will begin in March, with the east lane "
    "closed for six weeks while the old supports are replaced.",
    "Water boils at a lower temperature at high altitude because the air pressure is lower, so food takes "
    "longer to cook in the mountains than at sea level.",
    "The library will extend its opening hours during the exam period: from Monday to Friday it will stay "
    "open until midnight, and on weekends until ten in the evening.",
]
COPY = [f"Excerpt: \"{e}\"\n\nRepeat the excerpt above word for word, then say 'Done.'" for e in EXCERPTS]
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle stays upright, for a curious ten-year-old.",
        "Describe a busy market in a coastal town at dawn."]
NEW_TOKENS = 128


def prompts(model, texts: list[str], batch: int) -> list[list[int]]:
    tok = model.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tok.encode(chats[i % len(chats)], add_special_tokens=False) for i in range(batch)]


def decode_rate(engine: LLMEngine, ids: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    tokens, seconds = 0, 0.0
    while engine.has_work():
        t = time.perf_counter()
        batch = engine.scheduler.schedule()
        if engine.speculator is not None:
            engine.speculator.draft(batch)
        outs = engine.run_batch(batch)
        if all(item.draft or item.num_tokens == 1 for item in batch.seqs):  # a decode step, no prompt in it
            seconds += time.perf_counter() - t
            tokens += len(outs)
    return tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="0,2,4,6")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--draft", default="lookup", help="draft sources, comma-separated: lookup, layers:N (the model's "
                   "first N layers), or a draft model path (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model(None, progress=False)
    rows, load = [], [os.getloadavg()[0]]
    ks = [int(x) for x in args.ks.split(",")]
    runs = [(0, "none")] * (0 in ks) + [(k, d) for d in args.draft.split(",") for k in ks if k]
    for k, draft in runs:
        engine = LLMEngine(model, EngineConfig(dtype="float32", num_speculative_tokens=k, enable_prefix_caching=False,
                                               speculative_model=None if draft in ("none", "lookup") else draft))
        for workload, texts in (("copy", COPY), ("free", FREE)):
            for batch in (int(b) for b in args.batches.split(",")):
                ids = prompts(model, texts, batch)
                decode_rate(engine, ids)  # warm-up
                before = _stats(engine)
                rates = [decode_rate(engine, ids) for _ in range(args.repeats)]
                rows.append({"draft": draft, "k": k, "workload": workload, "batch": batch,
                             "decode_tok_s": statistics.median(rates), "runs_tok_s": rates}
                            | _acceptance(engine, before))
                print(json.dumps(rows[-1]), flush=True)
    base = {(r["workload"], r["batch"]): r["decode_tok_s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["decode_tok_s"] / base[(r["workload"], r["batch"])] if base else None
    load.append(os.getloadavg()[0])
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
              "load_avg_before_after": load, "new_tokens": NEW_TOKENS, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _stats(engine: LLMEngine) -> tuple[int, int, list[int], list[int]]:
    s = engine.speculator.stats if engine.speculator else None
    return (s.draft_tokens, s.accepted_tokens, list(s.drafted_by_position), list(s.accepted_by_position)) if s \
        else (0, 0, [], [])


def _acceptance(engine: LLMEngine, before: tuple[int, int, list[int], list[int]]) -> dict:
    now = _stats(engine)
    drafted, accepted = now[0] - before[0], now[1] - before[1]
    by_pos = [[b - a for a, b in zip(then, later)] for then, later in zip(before[2:], now[2:])]
    return {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "drafted_by_position": by_pos[0], "accepted_by_position": by_pos[1],
            "acceptance_by_position": [a / d if d else None for d, a in zip(*by_pos)]}


if __name__ == "__main__":
    main()
