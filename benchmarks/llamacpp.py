"""inferd (fp32, int8 weights, and int4 with bf16 activations where the CPU has native bf16) against llama.cpp
on the same SmolLM2 GGUF file, in one run.

Same workload as benchmarks/engine.py, same random token ids for every engine:
  decode B: B sequences of 128 prompt tokens, 128 new tokens each, greedy, no EOS stop;
            aggregate tok/s = tokens after the first / time of the decode steps (sampling included).
  prefill:  one 1,024-token prompt, tokens / time to its first token's logits.
llama.cpp runs through llama-cpp-python's low-level API in its own venv (never a dependency of inferd):
one llama_batch per step holding one token of each of the B sequences (seq ids 0..B-1, logits for all),
greedy = argmax over the returned logits; prefill = llama_decode of the whole prompt, logits for the last
token. It computes on the GGUF's own Q4_1 weights (no dequantization), KV cache f16, the same threads as inferd (--threads).

    PYTHONPATH=. .venv/bin/python benchmarks/llamacpp.py --threads 1 --out benchmarks/results/llamacpp-1t.json  # ~20 min

An AVX2 machine's code on an AVX-512 one: llama.cpp built for AVX2 alone in a venv of its own (CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" pip install --no-cache-dir llama-cpp-python==0.3.36),
and inferd's kernels, oneDNN, torch and MKL kept to AVX2 (benchmarks/limits.py, ISA_LIMITS):

    INFERD_KERNEL_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        PYTHONPATH=. .venv/bin/python benchmarks/llamacpp.py --llama-python AVX2_VENV/bin/python --variants float32/none,float32/int8,float32/int4

On first use it creates benchmarks/.venvs/llama (python3.11 -m venv, then pip install
llama-cpp-python==0.3.36, which builds llama.cpp: 11-45 minutes); --llama-python names another python.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 128, 128, 1024
LLAMA_VENV, LLAMA_PACKAGES = "benchmarks/.venvs/llama", ["llama-cpp-python==0.3.36"]  # venv relative to the repo root


def median_of(fn, repeats: int) -> dict:
    runs = [fn() for _ in range(repeats)]
    return {"median_tok_s": round(statistics.median(runs), 1), "runs_tok_s": [round(r, 1) for r in runs]}


# ---- llama.cpp (runs in the llama-cpp-python venv: no torch, no inferd)

class LlamaCpp:
    def __init__(self, path: str, threads: int, extra_bufts: bool):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        assert self.model, f"llama.cpp could not load {path}"
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.ctx = None

    def new_context(self, seqs: int, tokens_per_seq: int) -> dict:
        lc = self.lc
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        p = lc.llama_context_default_params()
        p.n_seq_max, p.n_ctx = seqs, seqs * tokens_per_seq
        p.n_threads = p.n_threads_batch = self.threads
        self.ctx = lc.llama_init_from_model(self.model, p)
        assert self.ctx, "llama.cpp could not create a context"
        return {"n_ctx": p.n_ctx, "n_batch": p.n_batch, "n_ubatch": p.n_ubatch, "n_seq_max": p.n_seq_max,
                "flash_attn_type": p.flash_attn_type, "type_k": p.type_k, "type_v": p.type_v,
                "kv_unified": p.kv_unified}

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits). Returns the argmax token of each row with logits."""
        import numpy as np

        lc = self.lc
        batch = lc.llama_batch_init(len(items), 0, 1)
        try:
            batch.n_tokens = len(items)
            for i, (token, pos, seq, logits) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            assert lc.llama_decode(self.ctx, batch) == 0, "llama_decode failed"
            rows = sum(1 for item in items if item[3])
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))
            return logits.argmax(axis=1).tolist()
        finally:
            lc.llama_batch_free(batch)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode_tok_s(self, prompts: list[list[int]]) -> float:
        self.clear()
        nxt = [self.decode([(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)])[0]
               for s, ids in enumerate(prompts)]
        elapsed = 0.0
        for step in range(NEW_TOKENS - 1):
            t = time.perf_counter()
            nxt = self.decode([(tok, PROMPT_LEN + step, s, True) for s, tok in enumerate(nxt)])
            elapsed += time.perf_counter() - t
        return len(prompts) * (NEW_TOKENS - 1) / elapsed

    def prefill_tok_s(self, ids: list[int]) -> float:
        self.clear()
        t = time.perf_counter()
        self.decode([(tok, p, 0, p == len(ids) - 1) for p, tok in enumerate(ids)])
        return len(ids) / (time.perf_counter() - t)


def llamacpp_worker(spec: dict) -> dict:
    import llama_cpp

    engine = LlamaCpp(spec["model_path"], spec["threads"], spec["extra_bufts"])
    out = {"version": llama_cpp.__version__, "use_extra_bufts": spec["extra_bufts"], "threads": spec["threads"],
           "decode": {}, "context": {}}
    out["context"]["prefill"] = engine.new_context(1, 2048)
    out["prefill"] = median_of(lambda: engine.prefill_tok_s(spec["prefill_ids"]), spec["repeats"])
    for b in spec["batches"]:
        out["context"][str(b)] = engine.new_context(b, PROMPT_LEN + NEW_TOKENS)
        out["decode"][str(b)] = median_of(lambda: engine.decode_tok_s(spec["prompts"][:b]), spec["repeats"])
        _log(f"llama.cpp B={b}: {out['decode'][str(b)]}")
    return out


# ---- inferd (this venv)

def inferd_results(model, dtype: str, quantization: str, batches: list[int], repeats: int, threads: int) -> dict:
    from benchmarks.engine import inferd_decode, inferd_prefill
    from inferd.engine.config import EngineConfig
    from inferd.engine.engine import LLMEngine

    engine = LLMEngine(model, EngineConfig(dtype=dtype, quantization=quantization, max_num_seqs=max(batches),
                                           max_num_batched_tokens=max(batches) * PROMPT_LEN, kv_cache_gib=2.0,
                                           num_threads=threads, small_step_threads=threads,  # llama.cpp's threads
                                           enable_prefix_caching=False))                   # at every batch size
    out = {"dtype": dtype, "quantization": quantization, "decode": {}}
    out["prefill"] = median_of(lambda: inferd_prefill(engine), repeats)
    for b in batches:
        out["decode"][str(b)] = median_of(lambda: inferd_decode(engine, b), repeats)
        _log(f"inferd {dtype} {quantization} B={b}: {out['decode'][str(b)]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="threads of both engines (default: torch's, all cores)")
    ap.add_argument("--llama-python", default=None,
                    help=f"python with llama-cpp-python (default: {LLAMA_VENV}/bin/python, created if absent)")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp repack weights into its extra buffer types (off by default)")
    ap.add_argument("--skip-inferd", action="store_true")
    ap.add_argument("--variants", default=None, help="inferd's dtype/quantization pairs (default: float32/none, "
                    "float32/int8, and bfloat16/int4 where the CPU has native bf16)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # llama.cpp side: spec on stdin
    args = ap.parse_args()
    if args.worker:
        json.dump(llamacpp_worker(json.load(sys.stdin)), sys.stdout)
        return
    from datetime import datetime, timezone

    import torch

    from benchmarks import limits
    from benchmarks.engine import random_prompts
    from benchmarks.machine import cpu_name
    from benchmarks.venvs import ensure_venv
    from inferd.models.loader import default_model_path, load_model

    llama_python = args.llama_python or ensure_venv(Path(__file__).resolve().parents[1] / LLAMA_VENV, LLAMA_PACKAGES,
                                                    " (it builds llama.cpp from source: 11-45 minutes, once)")
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(None, progress=False)
    vocab = model.config.vocab_size
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": str(default_model_path().name),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "load_average_before": loadavg(), "isa_limits": limits.isa_limits()},
              "workload": {"prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS, "prefill_tokens": PREFILL_LEN,
                           "repeats": args.repeats}}
    spec = {"model_path": str(default_model_path()), "threads": torch.get_num_threads(), "repeats": args.repeats,
            "extra_bufts": args.llama_extra_bufts, "batches": batches,
            "prompts": random_prompts(max(batches), PROMPT_LEN, vocab),
            "prefill_ids": random_prompts(1, PREFILL_LEN, vocab, seed=1)[0]}
    proc = subprocess.run([str(llama_python), os.path.abspath(__file__), "--worker"], input=json.dumps(spec),
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"llama.cpp worker failed:\n{proc.stderr[-3000:]}")
    result["llama.cpp"] = json.loads(proc.stdout)
    if not args.skip_inferd:
        from inferd.kernels.select import native_bf16
        default = "float32/none,float32/int8" + (",bfloat16/int4" if native_bf16() else "")
        for variant in (args.variants or default).split(","):
            dtype, quantization = variant.split("/")
            result[f"inferd {dtype} {quantization}"] = inferd_results(model, dtype, quantization, batches,
                                                                      args.repeats, torch.get_num_threads())
    result["machine"]["load_average_after"] = loadavg()
    from benchmarks.quantization import save_report  # here: the llama.cpp worker's venv has no torch
    save_report(result, markdown(result), args.out)


def markdown(r: dict) -> str:
    names = [n for n in r if n.startswith("inferd ")] + ["llama.cpp"]
    label = {"inferd none": "inferd fp32", "inferd int8": "inferd int8 weights", "llama.cpp": "llama.cpp Q4_1"} | {
        n: n for n in names if n.count(" ") == 2}  # older reports: "inferd none"; now "inferd DTYPE QUANTIZATION"
    rows = [("prefill 1,024 tokens", lambda d: d["prefill"])] + [
        (f"decode B={b} (aggregate)", lambda d, b=b: d["decode"][b]) for b in r["llama.cpp"]["decode"]]
    lines = [f"# inferd vs llama.cpp {r['llama.cpp']['version']} on {r['model']} ({r['date']}; "
             f"{r['machine']['cpu']}, {r['machine']['threads']} threads, ISA limits: "
             f"{r['machine'].get('isa_limits', 'none')}; load average before "
             f"{r['machine']['load_average_before']}, after {r['machine']['load_average_after']})", "",
             "tokens/s, median of " + str(r["workload"]["repeats"]) + " runs", "",
             "| | " + " | ".join(label[n] for n in names) + " | best inferd / llama.cpp |",
             "|---" * (len(names) + 2) + "|"]
    for text, get in rows:
        best = max(get(r[n])["median_tok_s"] for n in names[:-1]) if len(names) > 1 else float("nan")
        lines.append(f"| {text} | " + " | ".join(str(get(r[n])["median_tok_s"]) for n in names)
                     + f" | {best / get(r['llama.cpp'])['median_tok_s']:.2f}x |")
    return "\n".join(lines)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
