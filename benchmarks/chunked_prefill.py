"""Chunked prefill: inter-token latency of running streams while long prompts arrive, per token budget.

16 streams decode (64-token prompts, no EOS stop) while three 2,000-token prompts arrive one after
another (each once the previous one has its first token). With a token budget at least the prompt's
length, a prompt is prefilled in one step and every stream waits for it; with a smaller budget the
prompt is cut into chunks that share steps with the decodes. Reported per budget: the streams'
inter-token latency (p50, p99, max) while the long prompts are in flight, their decode rate, and the
long prompts' time to first token.

    python benchmarks/chunked_prefill.py --out benchmarks/results/chunked_prefill.json
"""
import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

STREAMS, STREAM_PROMPT, LONG_PROMPT, LONG_PROMPTS = 16, 64, 2000, 3


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return torch.randint(100, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(model, budget: int) -> dict:
    engine = LLMEngine(model, EngineConfig(dtype="float32", max_num_batched_tokens=budget, max_model_len=4096,
                                           kv_cache_gib=1.5, enable_prefix_caching=False))
    vocab = model.config.vocab_size
    endless = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(STREAMS, STREAM_PROMPT, vocab, 0)):
        engine.add_request(f"s{i}", ids, endless)
    last: dict[str, float] = {}
    while len(last) < STREAMS:  # every stream decoding
        for out in engine.step():
            last[out.request_id] = time.monotonic()
    gaps, ttfts, tokens = [], [], 0
    window_start = time.monotonic()
    for k, ids in enumerate(prompts(LONG_PROMPTS, LONG_PROMPT, vocab, 1)):
        arrival = time.monotonic()
        engine.add_request(f"long{k}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while f"long{k}" in engine.seqs:
            for out in engine.step():
                now = time.monotonic()
                if out.request_id.startswith("long"):
                    ttfts.append(now - arrival)
                else:
                    gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
                    tokens += 1
    window_s = time.monotonic() - window_start
    for i in range(STREAMS):
        engine.abort(f"s{i}")
    return {"max_num_batched_tokens": budget, "chunked": budget < LONG_PROMPT + STREAMS,
            "itl_p50_ms": 1000 * statistics.median(gaps), "itl_p99_ms": 1000 * quantile(gaps, 0.99),
            "itl_max_ms": 1000 * max(gaps), "stream_decode_tok_s": tokens / window_s,
            "long_prompt_ttft_s": statistics.median(ttfts), "window_s": window_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", default="4096,1024,512,256,128")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model(None, progress=False)
    load_before = os.getloadavg()[0]
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        rows.append(run(model, budget))
        print(json.dumps(rows[-1]), flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor()
              or platform.machine(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "model": model.name, "dtype": "float32", "load_avg_before_after": [load_before, os.getloadavg()[0]],
              "streams": STREAMS, "long_prompt_tokens": LONG_PROMPT, "long_prompts": LONG_PROMPTS, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
