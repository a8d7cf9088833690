"""Embeddings of the packaged all-MiniLM-L6-v2, in one run: inferd's runtime in process, sentence-transformers
`encode` in process (fp32, its default, and bf16), inferd's embedding server over HTTP, and infinity-emb
serving the same unpacked directory over HTTP; plus our forward alone in fp32 and bf16.

One client, closed loop: each request embeds `batch` texts (client batch sizes 1, 8, 32, 128) of about 16
(short) or 200 (long) tokens, special tokens included, each text different; inputs/s = inputs / wall time,
latency per request, p50/p99 (few samples at large batches: see `requests`). Each cell runs for about
--budget-s seconds (at least 3 requests) after one warm-up request. HTTP clients send base64 (what the
openai SDK asks for) and decode it. Cost per million tokens = core-hour price x cores x seconds per Mtok / 3600.

    PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py --out benchmarks/results/embeddings.json  # ~5 min

On first use it creates benchmarks/.venvs/infinity (python3.11 -m venv; pip install the CPU torch and
infinity-emb[server,torch]); when that fails or the server does not start, the results say why.
"""
import argparse
import asyncio
import base64
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import torch

from benchmarks.embeddings_report import markdown
from benchmarks.venvs import ensure_venv
from inferd.embeddings.config import EmbeddingConfig
from inferd.embeddings.runtime import EmbeddingRuntime
from inferd.models.bert import BertEncoder, load_weights
from inferd.kernels.variants import cpu_flags
from inferd.models.packed import pack_linears
from inferd.models.sentence import load_embedding_model
from inferd.models.loader import default_model_path

ROOT = Path(__file__).parents[1]
SIZES, LENGTHS = (1, 8, 32, 128), {"short": 16, "long": 200}
INFINITY_VENV = ROOT / "benchmarks" / ".venvs" / "infinity"
INFINITY_PACKAGES = ["torch==2.13.0", "infinity-emb[server,torch]==0.0.78"]  # pip's own config finds the CPU wheel
WORDS = ("a quiet morning the harbour filled with fishing boats while merchants argued over the price of salt "
         "wool timber and copper and children ran between the carts shouting the names of ships").split()


def texts(tokenizer, target_tokens: int, count: int) -> list[str]:
    """count different texts of target_tokens tokens each ([CLS] and [SEP] included)."""
    out = []
    for i in range(count):
        words = [str(i)] + [WORDS[(i * 13 + j * 7) % len(WORDS)] for j in range(target_tokens)]
        while len(tokenizer.encode(" ".join(words)).ids) > target_tokens:
            words.pop()
        out.append(" ".join(words))
    return out


def measure(embed, pool: list[str], batch: int, budget_s: float) -> dict:
    embed(pool[:batch])  # warm-up
    latencies_s, started, at = [], time.perf_counter(), 0
    while len(latencies_s) < 3 or time.perf_counter() - started < budget_s:
        chunk = [pool[(at + k) % len(pool)] for k in range(batch)]
        at += batch
        t = time.perf_counter()
        vectors = embed(chunk)
        latencies_s.append(time.perf_counter() - t)
        assert len(vectors) == batch and len(vectors[0]) == 384
    wall_s = time.perf_counter() - started
    ms = sorted(x * 1000 for x in latencies_s)
    return {"requests": len(ms), "inputs_s": round(len(ms) * batch / wall_s, 1),
            "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1)}


def matrix(name: str, embed, pools: dict[str, list[str]], budget_s: float) -> dict:
    cells = {}
    for length, pool in pools.items():
        for batch in SIZES:
            cells[f"{length}/{batch}"] = measure(embed, pool, batch, budget_s)
            print(f"{name:28s} {length:5s} batch {batch:3d}: {cells[f'{length}/{batch}']}", flush=True)
    return cells


# the systems

def inferd_runtime(files, pools: dict, budget_s: float) -> tuple[str, dict]:
    """The runtime's default settings (dtype auto), its batcher on an event loop of its own."""
    loop = asyncio.new_event_loop()
    runtime = EmbeddingRuntime(files, EmbeddingConfig())
    loop.run_until_complete(_started(runtime))
    def embed(batch: list[str]) -> torch.Tensor:
        return loop.run_until_complete(runtime.embed(runtime.tokenize(batch)))
    try:
        return runtime.info.dtype, matrix("inferd runtime", embed, pools, budget_s)
    finally:
        loop.run_until_complete(runtime.stop())
        loop.close()


async def _started(runtime: EmbeddingRuntime) -> None:
    runtime.start()


def sentence_transformers(directory: Path, dtype: torch.dtype):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(directory), device="cpu").to(dtype)
    return lambda batch: model.encode(batch)


def http(url: str, model: str):
    client = httpx.Client(timeout=600)

    def embed(batch: list[str]) -> list[np.ndarray]:
        r = client.post(url, json={"input": batch, "model": model, "encoding_format": "base64"})
        r.raise_for_status()
        return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    return embed


def started_server(command: list[str], ready_url: str, env: dict, log: str, timeout_s: float = 180,
                   cwd: Path = ROOT, verify=True) -> subprocess.Popen:
    """The server's output goes to benchmarks/.venvs/<log>.log (ignored by git); cwd: where it runs (`python -m`
    imports inferd from there first); verify: how an https ready_url's certificate is checked (httpx's)."""
    logs = ROOT / "benchmarks" / ".venvs"
    logs.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command, env=os.environ | env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=open(logs / f"{log}.log", "w"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(ready_url, timeout=2, verify=verify).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{command[0]} did not answer {ready_url} within {timeout_s:.0f} s (exit {proc.poll()})")


def text_server_command(folder: Path, port: int, key: str, *flags: str) -> list[str]:
    """`inferd serve` of the packaged SmolLM2 alone (no embedding, classical or policy model), its store and usage
    journal in folder (one server each), with flags after."""
    return [sys.executable, "-m", "inferd.cli", "serve", str(default_model_path()), "--port", str(port),
            "--api-key", key, "--db", f"sqlite:///{folder / 'inferd.db'}", "--usage-journal",
            str(folder / "usage.journal"), "--embedding-model", "none", "--classical-model", "none",
            "--policy-model", "none", "--log-level", "warning", *flags]


def stopped(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def inferd_server(port: int) -> subprocess.Popen:
    code = ("from inferd.embeddings.server import serve_embeddings; "
            f"serve_embeddings(None, port={port}, log_level='warning')")
    return started_server([sys.executable, "-c", code], f"http://127.0.0.1:{port}/ready", {"PYTHONPATH": str(ROOT)},
                          "inferd-server")


def infinity_version() -> str:
    python = ensure_venv(INFINITY_VENV, INFINITY_PACKAGES, " (the CPU torch wheel, then infinity-emb)")
    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('infinity-emb'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def infinity_server(directory: Path, port: int, dtype: str) -> subprocess.Popen:
    """Its defaults (batch size 32, its warm-up) but the dtype; offline, no usage statistics."""
    command = [str(INFINITY_VENV / "bin" / "infinity_emb"), "v2", "--model-id", str(directory), "--served-model-name",
               "minilm", "--engine", "torch", "--device", "cpu", "--dtype", dtype, "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    return started_server(command, f"http://127.0.0.1:{port}/health", env, f"infinity-{dtype}")


def peer_runs(result: dict, directory: Path, pools: dict, args) -> None:
    """infinity-emb in fp32 (its default on a CPU) and bf16; what stops it is noted, and the run goes on."""
    try:
        ver = infinity_version()
        for dtype in ("float32", "bfloat16"):
            proc = infinity_server(directory, args.port + 1, dtype)
            try:
                result["systems"][f"infinity-emb {ver} (HTTP, {dtype})"] = matrix(
                    f"infinity-emb {dtype}", http(f"http://127.0.0.1:{args.port + 1}/embeddings", "minilm"), pools,
                    args.budget_s)
            finally:
                stopped(proc)
    except (RuntimeError, OSError, SystemExit, subprocess.CalledProcessError, httpx.HTTPError) as exc:
        result["notes"]["infinity-emb"] = f"not measured: {type(exc).__name__}: {exc}"
        print(result["notes"]["infinity-emb"], flush=True)


def forward_dtypes(files) -> dict:
    """Our encoder alone (linears prepacked, as the runtime runs it), batch 32: is bf16 faster than fp32 on this
    CPU? The two dtypes alternate, so that load from elsewhere falls on both; min and median ms of the runs."""
    encoders = {}
    for dtype in (torch.float32, torch.bfloat16):
        encoders[str(dtype).removeprefix("torch.")] = encoder = BertEncoder(files.config)
        load_weights(encoder, files.weights)
        pack_linears(encoder.eval().to(dtype), dtype)
    out = {}
    for length, repeats in zip(LENGTHS.values(), (15, 5)):
        ids, mask = torch.randint(1000, 20000, (32, length)), torch.ones(32, length, dtype=torch.bool)
        runs = {name: [] for name in encoders}
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms up
                for name, encoder in encoders.items():
                    t = time.perf_counter()
                    encoder(ids, mask)
                    runs[name].append((time.perf_counter() - t) * 1000)
        for name, ms in runs.items():
            timed = ms[1:]
            out[f"{name}/32x{length}"] = {"min_ms": round(min(timed), 1),
                                          "median_ms": round(statistics.median(timed), 1)}
    return out


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "bf16_flags": sorted({"avx512_bf16", "amx_bf16", "amx_tile"} & cpu_flags()),
            "python": platform.python_version(), "torch": torch.__version__,
            "sentence_transformers": version("sentence-transformers"), "shared": True,
            "load_average_before": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embeddings.json")
    p.add_argument("--budget-s", type=float, default=2.0, help="seconds per cell (at least 3 requests)")
    p.add_argument("--core-hour-usd", type=float, default=0.04, help="price of one core for one hour")
    p.add_argument("--port", type=int, default=8950)
    args = p.parse_args()
    files = load_embedding_model()
    pools = {name: texts(files.tokenizer, n, 256) for name, n in LENGTHS.items()}
    tokens = {name: statistics.mean(len(files.tokenizer.encode(t).ids) for t in pool) for name, pool in pools.items()}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "mean_tokens": tokens, "budget_s": args.budget_s, "core_hour_usd": args.core_hour_usd,
              "forward_ms": forward_dtypes(files), "systems": {}, "notes": {}}
    print("forward alone, ms:", result["forward_ms"], flush=True)
    dtype, cells = inferd_runtime(files, pools, args.budget_s)
    result["systems"][f"inferd runtime ({dtype})"] = cells
    for st_dtype in (torch.float32, torch.bfloat16):
        name = f"sentence-transformers {version('sentence-transformers')} ({str(st_dtype).removeprefix('torch.')})"
        result["systems"][name] = matrix(name, sentence_transformers(files.directory, st_dtype), pools, args.budget_s)
    proc = inferd_server(args.port)  # dtype auto too: the same dtype as the runtime's
    try:
        result["systems"][f"inferd server (HTTP, {dtype})"] = matrix(
            "inferd server", http(f"http://127.0.0.1:{args.port}/v1/embeddings", "all-MiniLM-L6-v2"), pools,
            args.budget_s)
    finally:
        stopped(proc)
    peer_runs(result, files.directory, pools, args)
    result["machine"]["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
