"""Prefix cache, document-assistant workload: TTFT of questions about one ~1,000-token document, warm vs cold.

Each question is a chat prompt (system line, the document, the question) run in-process through the engine
(greedy, 8 new tokens). TTFT = add_request to the step that yields the first token, nothing else running.
  cold-off: an engine with enable_prefix_caching=False
  cold-ns:  the cached engine, each question in a namespace of its own (nothing to hit: lookup cost only)
  warm:     the cached engine, one namespace, primed by one earlier question about the same document
The three run interleaved, question by question; figures are medians over the questions. Greedy tokens are
compared across the three (a hit must not change the answer).

    PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache.json
"""
import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from benchmarks.machine import describe
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

SYSTEM = "You answer questions about the document the user gives, briefly and only from it."
TOPICS = ["library", "pool", "museum", "market", "clinic", "station", "archive", "garden", "harbour", "workshop"]
QUESTIONS = ["When does the library open on Sundays?", "Who runs the pool?", "How much is a museum ticket?",
             "Where is the market held in winter?", "What must visitors bring to the clinic?",
             "How often do trains leave the station?", "Can I borrow books from the archive?",
             "Who waters the garden in August?", "Which boats may use the harbour?", "Is the workshop free?",
             "What happens when the pool closes early?", "Which place opens first in the morning?"]
COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache.json"
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def document(tokenizer, num_tokens: int) -> str:
    """Numbered paragraphs about town services, cut to about num_tokens tokens."""
    paragraphs, i = [], 0
    while len(tokenizer.encode("\n".join(paragraphs), add_special_tokens=False)) < num_tokens:
        topic = TOPICS[i % len(TOPICS)]
        paragraphs.append(f"{i + 1}. The {topic} opens at {6 + i % 5}:00 on weekdays and at {8 + i % 3}:30 on "
                          f"Sundays. It is run by the town's {topic} board, which meets every {2 + i % 4} weeks. "
                          f"Rule {i + 1}: visitors of the {topic} sign the register and keep the entrance clear.")
        i += 1
    return "\n".join(paragraphs)


def prompt_ids(tokenizer, doc: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def ask(engine: LLMEngine, rid: str, ids: list[int], namespace: str) -> dict:
    t = time.perf_counter()
    engine.add_request(rid, ids, PARAMS, namespace)
    ttft_s, tokens, cached = None, [], 0
    while engine.has_work():
        for out in engine.step():
            ttft_s = ttft_s or time.perf_counter() - t
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return {"ttft_s": round(ttft_s, 4), "cached_tokens": cached, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: packaged SmolLM2)")
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS) - 1, help="timed questions (one more primes)")
    ap.add_argument("--out", default=None, help="JSON path; a .md table is written beside it")
    args = ap.parse_args()
    model = load_model(args.model, progress=False)
    engines = {"cached": LLMEngine(model, EngineConfig()),
               "off": LLMEngine(model, EngineConfig(enable_prefix_caching=False))}
    doc = document(model.tokenizer, args.document_tokens)
    prompts = [prompt_ids(model.tokenizer, doc, q) for q in QUESTIONS[:args.questions + 1]]
    for name, engine in engines.items():  # first-use costs (kernel build, oneDNN primitives) out of the timings
        ask(engine, f"warmup-{name}", prompts[0], "warmup")
    primed = ask(engines["cached"], "prime", prompts[0], "doc")
    runs = {"cold_off": [], "cold_ns": [], "warm": []}
    for i, ids in enumerate(prompts[1:]):
        runs["cold_off"].append(ask(engines["off"], f"off-{i}", ids, "doc"))
        runs["cold_ns"].append(ask(engines["cached"], f"ns-{i}", ids, f"fresh-{i}"))
        runs["warm"].append(ask(engines["cached"], f"warm-{i}", ids, "doc"))
        _log(" ".join(f"{k}={v[-1]['ttft_s']:.3f}s" for k, v in runs.items()) +
             f" warm_cached={runs['warm'][-1]['cached_tokens']}")
    result = summary(model, engines["cached"], doc, prompts, primed, runs)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write(report(result))


def summary(model, engine: LLMEngine, doc: str, prompts: list[list[int]], primed: dict, runs: dict) -> dict:
    median = {k: statistics.median(r["ttft_s"] for r in v) for k, v in runs.items()}
    same = all(a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(*runs.values()))
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
            "machine": describe() | {"threads": torch.get_num_threads()},
            "settings": {"dtype": str(engine.dtype).removeprefix("torch."), "block_size": engine.config.block_size,
                         "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                         "new_tokens": PARAMS.max_tokens},
            "workload": {"document_tokens": len(model.tokenizer.encode(doc, add_special_tokens=False)),
                         "prompt_tokens": [len(p) for p in prompts[1:]], "questions": len(prompts) - 1,
                         "primed_with_cached_tokens": primed["cached_tokens"]},
            "median_ttft_s": {k: round(v, 4) for k, v in median.items()},
            "speedup_warm_vs_cold_off": round(median["cold_off"] / median["warm"], 2),
            "speedup_warm_vs_cold_ns": round(median["cold_ns"] / median["warm"], 2),
            "warm_cached_tokens": [r["cached_tokens"] for r in runs["warm"]],
            "same_greedy_tokens": same,
            "runs": {k: [{"ttft_s": r["ttft_s"], "cached_tokens": r["cached_tokens"]} for r in v]
                     for k, v in runs.items()}}


def table(r: dict) -> str:
    m, w = r["median_ttft_s"], r["workload"]
    rows = ["| TTFT, median of %d questions | seconds | warm speedup |" % w["questions"], "|---|---|---|",
            f"| cold, prefix caching off | {m['cold_off']:.3f} | {r['speedup_warm_vs_cold_off']}x |",
            f"| cold, new namespace per question | {m['cold_ns']:.3f} | {r['speedup_warm_vs_cold_ns']}x |",
            f"| warm, same namespace | {m['warm']:.3f} | |"]
    notes = (f"\n{r['model']}, {r['settings']['dtype']}, {w['document_tokens']}-token document, prompts of "
             f"{min(w['prompt_tokens'])}-{max(w['prompt_tokens'])} tokens, warm hits "
             f"{min(r['warm_cached_tokens'])}-{max(r['warm_cached_tokens'])} cached tokens; same greedy tokens "
             f"in all three: {r['same_greedy_tokens']}; {r['machine']['cpu']}, {r['date']}.")
    return "\n".join(rows) + "\n" + notes


def report(r: dict) -> str:
    return (f"# Prefix cache: TTFT of questions about one document, warm vs cold\n\n{table(r)}\n\n"
            f"Cold prefills the whole prompt; warm computes only the question and the chat template's tail "
            f"(the last, partly filled block). Reproduce with `{COMMAND}`; settings are EngineConfig's defaults "
            f"(dtype auto, {r['settings']['block_size']}-token blocks, 1 GiB KV cache).\n")




def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
