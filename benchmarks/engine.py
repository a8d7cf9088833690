"""Engine throughput: inferd against Hugging Face transformers on the same weights, in one run.

Decode: B requests of 128 random prompt tokens, 128 new tokens each (greedy, no EOS stop);
throughput = tokens produced after the first / time of the decode steps.
Prefill: one 1,024-token prompt, tokens / time to its first token.
transformers runs its own KV cache (DynamicCache) in a manual loop, prefill with logits_to_keep=1.
inferd runs each of --formats (dtype:quantization), the same process and weights; every inferd format and
transformers dtype takes its turn in each repeat (round by round), so a shared machine's drift hits all alike.
Each figure is also a share of this machine's limits (benchmarks/limits.py), measured after every round: against
their medians, and each round against the limits measured right after it (the median of those: "paired").

    python benchmarks/engine.py --out benchmarks/results/engine.json
    python benchmarks/engine.py --formats bfloat16:none,float32:none,float32:int8,auto:int4,auto:auto \
        --out benchmarks/results/engine-zen4-avx512bf16.json
"""
import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine, resolve_dtype
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model
from benchmarks import limits
from benchmarks.machine import cpu_name, describe, loadavg

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 128, 128, 1024


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


# ---- inferd

def inferd_decode(engine: LLMEngine, batch: int, new_tokens: int = NEW_TOKENS) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(batch, PROMPT_LEN, engine.model.config.vocab_size)):
        engine.add_request(f"d{batch}-{i}", ids, params)
    decode_s, decode_tokens = 0.0, 0
    while engine.has_work():
        sched = engine.scheduler.schedule()
        t = time.perf_counter()
        outs = engine.run_batch(sched)
        if not sched.prefills:
            decode_s += time.perf_counter() - t
            decode_tokens += len(outs)
    assert decode_tokens == batch * (new_tokens - 1)
    return decode_tokens / decode_s


def inferd_prefill(engine: LLMEngine) -> float:
    (ids,) = random_prompts(1, PREFILL_LEN, engine.model.config.vocab_size, seed=1)
    engine.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return PREFILL_LEN / (time.perf_counter() - t)


# ---- transformers

def hf_model(model, dtype: torch.dtype):
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(model.weights, strict=False)
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(dtype).eval()


@torch.inference_mode()
def hf_decode(hf, batch: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor(random_prompts(batch, PROMPT_LEN, hf.config.vocab_size))
    cache = DynamicCache()
    out = hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter()
    for _ in range(NEW_TOKENS - 1):
        out = hf(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * (NEW_TOKENS - 1) / (time.perf_counter() - t)


@torch.inference_mode()
def hf_prefill(hf) -> float:
    ids = torch.tensor(random_prompts(1, PREFILL_LEN, hf.config.vocab_size, seed=1))
    t = time.perf_counter()
    hf(ids, use_cache=True, logits_to_keep=1)
    return PREFILL_LEN / (time.perf_counter() - t)


# ---- driver

def profile_step(engine: LLMEngine, batch: int) -> str:
    from torch.profiler import profile

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(batch, PROMPT_LEN, engine.model.config.vocab_size)):
        engine.add_request(f"prof-{i}", ids, params)
    for _ in range(4):
        engine.step()
    with profile() as prof:
        engine.step()
    while engine.has_work():
        engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def inferd_engine(model, spec: str, batches: list[int]) -> tuple[str, LLMEngine]:
    """The engine of format dtype:quantization and its label (what it resolved to)."""
    dtype, quantization, ops = (spec.split(":") + ["", ""])[:3]
    engine = LLMEngine(model, EngineConfig(dtype=dtype, quantization=quantization or "none",
                                           max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * PROMPT_LEN,
                                           kv_cache_gib=1.0, enable_prefix_caching=False,  # repeats must miss
                                           cpp_kernels=ops != "torch",
                                           small_step_threads=torch.get_num_threads()))  # the engine at its best
    label = str(engine.dtype).removeprefix("torch.")
    label += "" if engine.quantization == "none" else f" {engine.quantization}"
    label += " (auto)" if quantization == "auto" else ""
    return label + (" torch ops" if ops == "torch" else ""), engine


def interleaved(targets: dict, what: str, fn, repeats: dict[str, int], each_round=None) -> dict[str, dict]:
    """fn(target) for every target in turn, repeats[name] times each, round by round: the shared machine's
    drift hits all targets alike; each_round() after every round."""
    runs = {name: [] for name in targets}
    for round_ in range(max(repeats.values())):
        for name, target in targets.items():
            if round_ < repeats[name]:
                runs[name].append(fn(target))
                _log(f"{name} {what}: {runs[name][-1]:.1f} tok/s")
        if each_round is not None:
            each_round()
    return {name: {"median_tok_s": round(statistics.median(r), 1), "runs_tok_s": [round(x, 1) for x in r]}
            for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: packaged SmolLM2)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="auto:none",
                    help="inferd formats to run, comma-separated dtype:quantization[:torch] (e.g. bfloat16:none,"
                         "auto:int4); :torch runs the decoder's small ops in torch instead of the C++ kernels")
    ap.add_argument("--peer-dtypes", default="float32:3,bfloat16:1",
                    help="transformers dtypes to run, each with its number of repeats; empty: inferd only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = load_model(args.model, progress=False)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
              "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "python": platform.python_version(),
                          "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "load_average_before": loadavg(), "isa_limits": limits.isa_limits(),
                          "description": describe()},
              "workload": {"prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS, "prefill_tokens": PREFILL_LEN},
              "inferd": {}, "transformers": {}}
    if args.threads:
        torch.set_num_threads(args.threads)
        result["machine"]["cores"] = args.threads
    engines = dict(inferd_engine(model, spec, batches) for spec in args.formats.split(","))
    peers = {}
    if args.peer_dtypes:
        import transformers
        result["machine"]["transformers"] = transformers.__version__
        peers = {name: (hf_model(model, resolve_dtype(name)), int(n or 1))
                 for name, _, n in (spec.partition(":") for spec in args.peer_dtypes.split(","))}
    targets = {f"inferd {k}": ("inferd", e) for k, e in engines.items()}
    targets |= {f"transformers {k}": ("hf", m) for k, (m, _) in peers.items()}
    repeats = {name: args.repeats for name in targets} | {f"transformers {k}": n for k, (_, n) in peers.items()}
    limit_runs = []  # the machine's limits after every round: its speed drifts within a run

    def measure_limits():
        limit_runs.append(limits.machine_limits({e.dtype for e in engines.values()}))
        _log(f"limits: {limit_runs[-1]}")
    prefill = interleaved(targets, "prefill", lambda t: inferd_prefill(t[1]) if t[0] == "inferd" else hf_prefill(t[1]),
                          repeats, measure_limits)
    decode = {b: interleaved(targets, f"B={b}", lambda t, b=b: inferd_decode(t[1], b) if t[0] == "inferd"
                             else hf_decode(t[1], b), repeats, measure_limits) for b in batches}
    for name, (kind, target) in targets.items():
        row = {"prefill": prefill[name], "decode": {str(b): decode[b][name] for b in batches}}
        if kind == "inferd":
            row |= {"dtype": str(target.dtype).removeprefix("torch."), "quantization": target.quantization,
                    "profile_b1": profile_step(target, 1), "profile_b32": profile_step(target, 32)}
            result["inferd"][name.removeprefix("inferd ")] = row
        else:
            result["transformers"][name.removeprefix("transformers ")] = row
    result["machine"]["load_average_after"] = loadavg()
    result["limits_runs"] = limit_runs
    result["limits"] = limits.median_limits(limit_runs)
    rounds, blocks = max(repeats.values()), ["prefill", *(f"decode B={b}" for b in batches)]
    round_limits = {what: limit_runs[i * rounds:(i + 1) * rounds] for i, what in enumerate(blocks)}  # as they ran
    for name, engine in engines.items():
        result["inferd"][name]["share_of_limit"] = shares(result["inferd"][name], engine, result["limits"],
                                                          round_limits)
    print(_table(result))
    print(_share_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def shares(row: dict, engine: LLMEngine, machine: dict, rounds: dict[str, list[dict]]) -> dict:
    """Each figure of row as a share of this machine's limits (benchmarks/limits.py): against the run's median
    limits (of_limit), and each round against the limits measured right after it, their median (of_limit_paired:
    this machine's read bandwidth moves between ~35 and ~70 GB/s within minutes, so a round and a limit measured
    in different modes say little of each other)."""
    net, kv = engine.runner.model, engine.runner.kv_cache.element_size()
    figures = {"prefill": (row["prefill"], limits.prefill_cost(net, PREFILL_LEN), PREFILL_LEN)}
    for b, d in row["decode"].items():  # the decode's mean context
        figures[f"decode B={b}"] = (d, limits.decode_step_cost(net, int(b), PROMPT_LEN + NEW_TOKENS // 2, kv), int(b))
    out = {}
    for what, (figure, cost, tokens) in figures.items():
        paired = [limits.share(cost, tokens / tok_s, limit, engine.dtype)["of_limit"]
                  for tok_s, limit in zip(figure["runs_tok_s"], rounds[what])]
        out[what] = limits.share(cost, tokens / figure["median_tok_s"], machine, engine.dtype) | {
            "of_limit_paired": round(statistics.median(paired), 3), "of_limit_rounds": paired,
            "bytes_per_step_mb": round(cost["bytes"] / 1e6, 1), "gflop_per_step": round(cost["flop"] / 1e9, 2)}
    return out


def _share_table(r: dict) -> str:
    m = r["limits"]
    peaks = ", ".join(f"{d} {v:,.0f} GFLOP/s" for d, v in m["matmul_peak_gflop_s"].items())
    rows = [f"Share of this machine's limit (read bandwidth {m['read_bandwidth_gb_s']} GB/s; matmul peaks {peaks}): "
            "max(memory, compute), the bound in brackets; then the median of each round's share against the limits "
            "measured right after it", "",
            "| share of limit | " + " | ".join(f"inferd {f}" for f in r["inferd"]) + " |",
            "|---" * (len(r["inferd"]) + 1) + "|"]
    for what in r["inferd"][next(iter(r["inferd"]))]["share_of_limit"]:
        cells = [r["inferd"][f]["share_of_limit"][what] for f in r["inferd"]]
        rows.append(f"| {what} | " + " | ".join(f"{c['of_limit']:.0%} ({c['bound']}); {c['of_limit_paired']:.0%} paired"
                                                for c in cells) + " |")
    return "\n".join(rows)


def _table(r: dict) -> str:
    peers, formats = list(r["transformers"]), list(r["inferd"])
    columns = ["", *(f"inferd {f}" for f in formats), *(f"transformers {p}" for p in peers)]
    columns += ["best inferd / best transformers"] if peers else []
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    keys = [("prefill 1,024 tok/s", lambda d: d["prefill"])] + [
        (f"decode B={b} tok/s", lambda d, b=b: d["decode"][b]) for b in r["inferd"][formats[0]]["decode"]]
    for label, get in keys:
        ours = [get(r["inferd"][f])["median_tok_s"] for f in formats]
        theirs = [get(r["transformers"][p])["median_tok_s"] for p in peers]
        cells = [label, *ours, *theirs] + ([f"{max(ours) / max(theirs):.2f}x"] if theirs else [])
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
