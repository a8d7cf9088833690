"""Weight-only int8 and int4: which kernel, and what it costs in quality, on SmolLM2-135M-Instruct's real weights.

kernels: all 121 linears of the model (30 x qkv, o, gate_up, down + lm_head) at batch M, each candidate
against the fp32 oneDNN prepacked path the engine uses, with the output error of each against fp32. bf16
candidates (dense and int4) take bf16 activations, the others fp32.
quality: the engine's model fp32 (reference) against int8, int4 (as the engine serves it: the kernel up to
inferd.kernels.select's INT4 rows and dense bf16 weights above, lm_head int8 up to select.INT8_HEAD_MAX_ROWS rows and bf16 above,
so the 432-token text runs dense (and the 12 batched prompts too where max_rows is below 12); then the kernels and the int8 lm_head at every M;
then lm_head 4-bit too) and bf16 (the dtype the issue named, for scale):
logits on a fixed public-domain text (max abs diff, cosine, top-1 agreement, KL), its perplexity, and
greedy continuations of fixed chat prompts compared token by token. W8A8 (fbgemm dynamic, activations
quantized too) is measured beside weight-only int8 for comparison; the engine serves weight-only int8 only.

    PYTHONPATH=. python benchmarks/quantization.py --threads 1 --out benchmarks/results/quant.json   # ~15 minutes
    PYTHONPATH=. python benchmarks/quantization.py --threads 1 --sizes 1,2,4,8,16,32,64 \
        --candidates fp32,bf16,int4,C++ --out benchmarks/results/quant-zen4-avx512bf16.json
"""
import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.machine import cpu_name
from benchmarks.limits import isa_limits
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillChunk
from inferd.models.loader import load_model
from inferd.models.int4 import Int4Linear, int4_available
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.packed import PACK_FOR_BATCH
from inferd.models.quant import Int8Linear, SmallRowsInt8, quantize_int8
from inferd.kernels.variants import load_kernels
from inferd.kernels.select import bf16_weights

# Public domain: the opening of Dickens, A Tale of Two Cities (1859), and of the US Declaration of
# Independence (1776).
TEXT = """It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was \
the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, \
we had nothing before us, we were all going direct to Heaven, we were all going direct the other way -- in \
short, the period was so far like the present period, that some of its noisiest authorities insisted on its \
being received, for good or for evil, in the superlative degree of comparison only.

There were a king with a large jaw and a queen with a plain face, on the throne of England; there were a king \
with a large jaw and a queen with a fair face, on the throne of France. In both countries it was clearer than \
crystal to the lords of the State preserves of loaves and fishes, that things in general were settled for ever.

When in the Course of human events, it becomes necessary for one people to dissolve the political bands which \
have connected them with another, and to assume among the powers of the earth, the separate and equal station \
to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind \
requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their \
Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. \
That to secure these rights, Governments are instituted among Men, deriving their just powers from the consent \
of the governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the \
People to alter or to abolish it, and to institute new Government, laying its foundation on such principles and \
organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness."""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for a job interview.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "List the planets of the solar system in order.",
    "What does a CPU cache do?",
    "Suggest a name for a coffee shop.",
]
GREEDY_TOKENS = 64


# ---- kernels

class RowScaledDynamicInt8(nn.Module):
    """W8A8 for comparison: fbgemm's dynamic int8 linear (activations quantized per tensor, 7 bits) with each
    row first scaled to max |x| = 1, so that one row's outliers do not coarsen the others."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        assert lin.bias is None
        torch.backends.quantized.engine = "fbgemm"
        q, s = quantize_int8(lin.weight)
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros_like(s, dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        return torch.ops.quantized.linear_dynamic(x / r, self.packed, True) * r




def candidates(kernel) -> dict:
    """name -> (prepare(nn.Linear) -> state, call(state, x) -> y, largest M to time)."""
    def fp32(lin):
        return torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), PACK_FOR_BATCH)

    def dynamic(engine):
        def prepare(lin):
            torch.backends.quantized.engine = engine
            q, s = quantize_int8(lin.weight)
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros_like(s, dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, None)
        return prepare, lambda p, x: torch.ops.quantized.linear_dynamic(x, p, True), None

    out = {"fp32 oneDNN prepacked (current)": (fp32, lambda p, x: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [None], ""), None),
           "int8 aten._weight_int8pack_mm": (lambda lin: quantize_int8(lin.weight), lambda qs, x: torch.ops.aten._weight_int8pack_mm(
                x, qs[0], qs[1]), 64),  # 15 s a pass at M=64: larger M would take hours
           "int8 dynamic fbgemm (quantized.linear_dynamic)": dynamic("fbgemm"),
           "int8 dynamic oneDNN (quantized.linear_dynamic)": dynamic("onednn")}
    out["int8 dynamic fbgemm, rows scaled first"] = (RowScaledDynamicInt8, lambda m, x: m(x), None)
    if kernel is not None:
        out["int8 inferd C++ AVX2 kernel"] = (lambda lin: Int8Linear(lin, kernel), lambda m, x: m(x), None)
    out["bf16 oneDNN prepacked (bf16 x)"] = (lambda lin: fp32(lin.to(torch.bfloat16)), out[
        "fp32 oneDNN prepacked (current)"][1], None)
    if int4_available():
        out["int4 aten._weight_int4pack_mm_for_cpu (bf16 x)"] = (lambda lin: Int4Linear(lin, max_rows=1 << 30),
                                                                 lambda m, x: m(x), None)
    if load_int4_kernel() is not None:
        out["int4 inferd C++ AVX-512 BF16 kernel (bf16 x)"] = (
            lambda lin: Int4Linear(lin, max_rows=1 << 30, kernel=load_int4_kernel()), lambda m, x: m(x), None)
    return out


BF16_X = ("bf16 x",)  # candidates whose activations are bf16


def bench_kernels(linears: list[nn.Linear], sizes: list[int], kernel, only: list[str] | None = None,
                  repeats: int = 7) -> dict:
    """Every candidate prepared first; then at each M, each repeat times one pass of every candidate in turn, so
    that the machine's drift (it is shared) hits all of them alike. Medians."""
    g = torch.Generator().manual_seed(0)
    fp32_xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in {*sizes, 8}}
    bf16_xs = {m: {k: x.to(torch.bfloat16) for k, x in row.items()} for m, row in fp32_xs.items()}
    refs = [F.linear(fp32_xs[8][lin.in_features], lin.weight) for lin in linears]
    prepared, result = {}, {}
    for name, (prepare, call, max_m) in candidates(kernel).items():
        if only and not any(word in name for word in only):
            continue
        xs = bf16_xs if any(tag in name for tag in BF16_X) else fp32_xs
        states = [prepare(copy.deepcopy(lin)) for lin in linears]
        err = [((call(s, xs[8][lin.in_features]).float() - r).norm() / r.norm()).item()
               for s, lin, r in zip(states, linears, refs)]
        result[name] = {"rel_error_vs_fp32_M8": round(statistics.mean(err), 6), "ms": {}}
        prepared[name] = states, call, max_m, xs
    for m in sizes:
        runs = {name: [] for name, (_, _, max_m, _) in prepared.items() if max_m is None or m <= max_m}
        passes = {name: (lambda states=states, call=call, xs=xs: [call(s, xs[m][lin.in_features])
                                                                   for s, lin in zip(states, linears)])
                  for name, (states, call, _, xs) in prepared.items() if name in runs}
        for fn in passes.values():
            fn()  # warm-up
        for _ in range(3 if m >= 256 else repeats):
            for name, fn in passes.items():
                runs[name].append(_once_ms(fn))
        for name, times in runs.items():
            result[name]["ms"][str(m)] = round(statistics.median(times), 2)
            _log(f"{name} M={m}: {result[name]['ms'][str(m)]} ms")
    return result


# ---- quality

AUTO_BF16_WEIGHTS = "float32 rows on bf16 weights (--dtype auto here)"  # inferd.kernels.select.bf16_weights

@torch.inference_mode()
def all_logits(model: LlamaForCausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """fp32 logits of every position of one prompt, in one prefill over a private KV cache."""
    c, n = model.config, len(ids)
    nb = -(-n // block_size)
    cache = torch.zeros(c.num_layers, 2, nb * block_size, c.num_kv_heads, c.head_dim,
                        dtype=model.embed_tokens.weight.dtype)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode_tokens=0, block_size=block_size,
                             decode_blocks=None, decode_lens=None,
                             prefills=[PrefillChunk(0, n, torch.arange(nb), n)])
    return model(torch.tensor(ids), torch.arange(n), meta, cache, torch.arange(n))


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {str(i): [] for i in range(len(prompts))}
    for rid, ids in enumerate(prompts):
        engine.add_request(str(rid), ids, params)
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, ids: list[int], ref_greedy, new_greedy) -> dict:
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                   for x, y in zip(ref_greedy, new_greedy)]
    kl = F.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True, reduction="batchmean")
    return {"logits_max_abs_diff": round((logits - ref_logits).abs().max().item(), 4),
            "logits_mean_abs_diff": round((logits - ref_logits).abs().mean().item(), 5),
            "logits_cosine_mean": round(F.cosine_similarity(logits, ref_logits, dim=-1).mean().item(), 6),
            "logits_cosine_min": round(F.cosine_similarity(logits, ref_logits, dim=-1).min().item(), 6),
            "top1_agreement": round((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(), 4),
            "kl_ref_to_this_nats": round(kl.item(), 6),
            "perplexity": perplexity(logits, ids),
            "greedy_identical_prompts": sum(p == GREEDY_TOKENS for p in same_prefix),
            "greedy_mean_tokens_before_divergence": round(statistics.mean(same_prefix), 1)}


def _swap_linears(model: nn.Module, make) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return round(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item(), 3)


def quality(model, variants: dict[str, dict], only: str | None = None) -> dict:
    tokenizer = model.tokenizer
    ids = tokenizer.encode(TEXT)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                add_special_tokens=False) for p in PROMPTS]
    out, ref = {"text_tokens": len(ids), "prompts": len(prompts), "greedy_tokens": GREEDY_TOKENS}, None
    for name, settings in variants.items():
        if only and name != "fp32" and name not in only.split(";"):
            continue
        settings = dict(settings)
        w8a8 = settings.pop("w8a8_fbgemm", False)
        int4_lm_head = settings.pop("int4_lm_head", False)
        int4_max_rows = settings.pop("int4_max_rows", None)
        int8_rows = settings.pop("int4_int8_rows", "default")
        engine = LLMEngine(model, EngineConfig(max_num_seqs=len(prompts), kv_cache_gib=0.5, pack_weights=not w8a8,
                                               **settings))
        if w8a8:
            _swap_linears(engine.model, RowScaledDynamicInt8)
        if int4_lm_head:
            lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
            lm_head.weight = nn.Parameter(model.weights["model.embed_tokens.weight"].float(), requires_grad=False)
            engine.model.lm_head = Int4Linear(lm_head, engine.model.layers[0].mlp.down_proj.max_rows, load_int4_kernel())
        for layer in (m for m in engine.model.modules() if isinstance(m, (Int4Linear, SmallRowsInt8)) and int4_max_rows):
            layer.max_rows = int4_max_rows
        for layer in (m for m in engine.model.modules() if isinstance(m, Int4Linear) and int8_rows != "default"):
            layer.int8_rows = int8_rows
        engine.model.replan()  # linears replaced above
        logits, tokens = all_logits(engine.model, ids), greedy(engine, prompts)
        if ref is None:
            ref = logits, tokens
            out[name] = {"perplexity": perplexity(logits, ids)}
        else:
            out[name] = compare(ref[0], logits, ids, ref[1], tokens)
        _log(f"{name}: {out[name]}")
        del engine
    return out


# ---- driver

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,32,64,1024", help="batch sizes M of the kernel comparison")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--candidates", default=None, help="comma-separated words: time only kernels named with one")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--quality-only", default=None,
                    help="formats whose quality to check, separated by ; (fp32, the reference, always runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(None, progress=False)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
              "machine": {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa_limits": isa_limits(),
                          "load_average_before": _uptime()}}
    if not args.skip_kernels:
        net = LlamaForCausalLM(model.config, 16)
        net.load_weights(model.weights)
        linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
        result["kernels"] = bench_kernels(linears, [int(m) for m in args.sizes.split(",")], load_kernels(),
                                          args.candidates.split(",") if args.candidates else None)
        del net, linears
    if not args.skip_quality:
        result["quality"] = quality(model, {"fp32": {"dtype": "float32", "quantization": "none"},
                                            "int8": {"dtype": "float32", "quantization": "int8"},
                                            "int8 W8A8 fbgemm (rows scaled)": {"dtype": "float32",
                                                                               "w8a8_fbgemm": True},
                                            "bf16": {"dtype": "bfloat16", "quantization": "none"},
                                            **({AUTO_BF16_WEIGHTS: {"dtype": "auto", "quantization": "none"}}
                                               if bf16_weights() else {}),
                                            **({"int4": {"quantization": "int4"},
                                                "int4, kernel at every M": {"quantization": "int4",
                                                                            "int4_max_rows": 1 << 30,
                                                                            "int4_int8_rows": None},
                                                "int4, lm_head 4-bit too": {"quantization": "int4",
                                                                            "int4_lm_head": True}}
                                               if int4_available() else {}),
                                            **({"int4, int8 inputs (VNNI), kernel at every M": {
                                                "quantization": "int4", "int4_max_rows": 1 << 30, "int4_int8_rows": 1}}
                                               if load_int4_kernel() is not None
                                               and load_int4_kernel().int4_linear_bf16_native() else {}),
                                            **({"int4, float32 rows (AVX2 loops), kernel at every M": {
                                                "dtype": "float32", "quantization": "int4", "int4_max_rows": 1 << 30},
                                                "int4, float32 rows (AVX2 loops), 16-bit inputs at every M": {
                                                "dtype": "float32", "quantization": "int4", "int4_max_rows": 1 << 30,
                                                "int4_int8_rows": None}}
                                               if load_int4_kernel() is not None else {})}, args.quality_only)
    result["machine"]["load_average_after"] = _uptime()
    save_report(result, markdown(result), args.out)


def save_report(result: dict, md: str, out: str | None) -> None:
    """Print the Markdown table; with --out, write OUT (JSON) and OUT.md beside it."""
    print(md)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        with open(out.removesuffix(".json") + ".md", "w") as f:
            f.write(md + "\n")


def markdown(r: dict) -> str:
    lines = [f"# Weight-only int8 and int4 on {r['model']} ({r['date']}, torch {r['machine']['torch']}, "
             f"{r['machine']['threads']} threads, {r['machine']['cpu_capability']}; "
             f"limits: {r['machine'].get('isa_limits', 'none')}; "
             f"load average before {r['machine']['load_average_before']})", ""]
    if "kernels" in r:
        sizes = list(next(iter(r["kernels"].values()))["ms"])
        base = next(iter(r["kernels"].values()))["ms"]
        lines += ["All 121 linears of the model, ms per pass (speedup vs fp32 in brackets), and the mean "
                  "relative output error vs fp32 at M=8:", "",
                  "| candidate | " + " | ".join(f"M={m}" for m in sizes) + " | rel. error |",
                  "|---" * (len(sizes) + 2) + "|"]
        for name, row in r["kernels"].items():
            cells = [f"{row['ms'][m]} ({base[m] / row['ms'][m]:.2f}x)" if m in row["ms"] else "not run"
                     for m in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['rel_error_vs_fp32_M8']:.2e} |")
        lines.append("")
    if "quality" in r:
        q = r["quality"]
        variants = [k for k in q if isinstance(q[k], dict) and k != "fp32"]
        keys = list(q[variants[0]])
        lines += [f"Against fp32: logits over a {q['text_tokens']}-token public-domain text (teacher-forced), "
                  f"greedy continuations of {q['prompts']} chat prompts, {q['greedy_tokens']} tokens each. "
                  f"fp32 perplexity {q['fp32']['perplexity']}.", "",
                  "| metric | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(str(q[v][k]) for v in variants) + " |" for k in keys]
    return "\n".join(lines)


def _once_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _uptime() -> str:
    return subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.strip()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
