"""Served decode beside other work: `inferd serve` and vLLM CPU in turn, each alone, beside a busy process and
beside another model kind under load; and the embedding model beside text decode. One table.

Targets (started once, taking turns in every round, each round starting one further along, so that the machine's
drift and the order fall on all):
  serve:<fmt>  one `inferd serve --config` with a text deployment per format (served_decode.py's formats: e.g.
               auto:none, the default; auto:none+num_threads=1; auto:none+adapt_threads=false, the engine before
               it followed the free cores) and the default embedding deployment (all-MiniLM-L6-v2)
  vllm         vLLM CPU's own server on the same weights, started as inferd's vLLM runtime starts it
Conditions:
  alone   nothing else runs
  busy    one Python busy loop (a CPU-bound neighbour)
  embed   a client keeps inferd's embedding model busy (256 texts of ~40 tokens a request, one after another)
Decode tok/s at --batches streams (served_decode.py's light client and window); each condition's rate over the
same target's rate alone in the same round; medians over rounds. Then the embedding model's texts/s alone and
beside 8 streams of the default text deployment (the reverse of `embed`).

    PYTHONPATH=. .venv/bin/python benchmarks/neighbours.py --out benchmarks/results/neighbours.json
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.engine import PROMPT_LEN, random_prompts
from benchmarks.machine import cpu_name, loadavg
from benchmarks.served_decode import (KEY, SETTINGS, Served, decode_window, deployment_name, quiet, serve_spec,
                                      start_serve, streams)
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.engine.config import EngineConfig
from inferd.models.sentence import DEFAULT_EMBEDDING_NAME

CONDITIONS = ("alone", "busy", "embed")
BUSY = "while True: pass"
# an embedding client in its own process (its work is not the decode client's): texts/s after its first second
EMBED_CLIENT = """
import sys, time, httpx
url, key, model, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
texts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(256)]
done, start, end = 0, time.monotonic() + 1.0, time.monotonic() + seconds
with httpx.Client(timeout=120) as c:
    while time.monotonic() < end:
        r = c.post(f"{url}/v1/embeddings", json={"model": model, "input": texts},
                   headers={"authorization": f"Bearer {key}"})
        r.raise_for_status()
        if time.monotonic() > start:
            done += len(texts)
print(done / max(time.monotonic() - start, 1e-9))
"""


def embed_client(url: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", EMBED_CLIENT, url, KEY, DEFAULT_EMBEDDING_NAME, str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def texts_per_s(client: subprocess.Popen) -> float:
    out, _ = client.communicate(timeout=600)
    if client.returncode != 0:
        raise RuntimeError("the embedding client failed")
    return round(float(out.strip()), 1)


def decode_beside(target: Served, condition: str, batch: int, seed: int, vocab: int, new_tokens: int,
                  embed_url: str) -> float:
    neighbour = None
    if condition == "busy":
        neighbour = subprocess.Popen([sys.executable, "-c", BUSY])
    elif condition == "embed":
        neighbour = embed_client(embed_url, 3600)
    try:
        if neighbour is not None:
            time.sleep(1.5)  # the neighbour is running (and the engine has seen it)
        return round(target.decode(batch, seed, vocab, new_tokens), 1)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def embed_beside_decode(url: str, text: Served, seconds: float, vocab: int, seed: int) -> float:
    """The embedding client's texts/s while 8 text streams decode (they run longer than the client)."""
    async def both() -> float:
        prompts = random_prompts(8, PROMPT_LEN, vocab, seed=seed)
        decode = asyncio.ensure_future(streams(text.url, text.key, text.model, prompts, 2048, text.client))
        await asyncio.sleep(1.5)
        client = embed_client(url, seconds)
        rate = await asyncio.to_thread(texts_per_s, client)
        decode.cancel()
        try:
            await decode
        except (asyncio.CancelledError, Exception):
            pass
        return rate
    return asyncio.run(both())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="auto:none,auto:none+num_threads=1")
    ap.add_argument("--vllm-python", default=os.environ.get("INFERD_VLLM_PYTHON") or ".venv-vllm/bin/python",
                    help="'none': leave vLLM out")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--embed-seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    formats, batches = args.formats.split(","), [int(b) for b in args.batches.split(",")]
    conditions = args.conditions.split(",")
    vocab = 49152
    work = Path(tempfile.mkdtemp(prefix="neighbours-"))
    spec = serve_spec(formats) + (f"  - name: {DEFAULT_EMBEDDING_NAME}\n    kind: embedding\n"
                                  "    model: {source: default}\n")
    stops: list = []
    try:
        serve, url = start_serve(work, formats, spec)
        stops.append(serve.terminate)
        targets = [Served(f"serve:{f}", url, KEY, deployment_name(f), "light") for f in formats]
        if args.vllm_python != "none":
            vllm = RuntimeProcess(None, "smol-vllm", EngineConfig(**SETTINGS),
                                  EngineChoice("vllm", args.vllm_python, []))
            vllm.start()
            stops.append(vllm.stop)
            vllm.wait_ready(1800)
            targets.append(Served("vllm", vllm.url, vllm.api_key, "smol-vllm", "light"))
        for t in targets:
            t.decode(2, seed=999, vocab=vocab, new_tokens=8)  # warm-up
        texts_per_s(embed_client(url, 2.0))
        runs = {t.name: {f"{c}_b{b}": [] for c in conditions for b in batches} for t in targets}
        embed_runs: dict[str, list[float]] = {"alone": [], "beside_text_b8": []}
        seed = 0
        for r in range(args.rounds):
            for t in targets[r % len(targets):] + targets[:r % len(targets)]:  # each round starts with another
                for c in conditions:
                    for b in batches:
                        seed += 1
                        quiet()
                        runs[t.name][f"{c}_b{b}"].append(decode_beside(t, c, b, seed, vocab, args.new_tokens, url))
                print(f"round {r} {t.name}: {json.dumps({k: v[-1] for k, v in runs[t.name].items()})}",
                      file=sys.stderr, flush=True)
            quiet()
            embed_runs["alone"].append(texts_per_s(embed_client(url, args.embed_seconds)))
            quiet()
            seed += 1
            embed_runs["beside_text_b8"].append(embed_beside_decode(url, targets[0], args.embed_seconds, vocab, seed))
            print(f"round {r} embeddings: {json.dumps({k: v[-1] for k, v in embed_runs.items()})}", file=sys.stderr,
                  flush=True)
    finally:
        for stop in reversed(stops):
            stop()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "load_average_after": loadavg()},
              "settings": SETTINGS | {"formats": formats, "new_tokens": args.new_tokens, "rounds": args.rounds},
              "runs": runs, "embeddings": embed_runs,
              "medians": {n: {k: statistics.median(v) for k, v in by.items()} for n, by in runs.items()},
              "kept": kept(runs, conditions, batches),
              "embeddings_kept": statistics.median(b / a for a, b in zip(embed_runs["alone"],
                                                                         embed_runs["beside_text_b8"]))}
    text = markdown(result, conditions, batches)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out.removesuffix(".json") + ".md").write_text(text)


def kept(runs: dict, conditions: list[str], batches: list[int]) -> dict:
    """Per target, condition and batch: the median over rounds of (rate in the condition / rate alone)."""
    return {name: {f"{c}_b{b}": round(statistics.median(x / a for x, a in zip(by[f"{c}_b{b}"], by[f"alone_b{b}"])), 3)
                   for c in conditions if c != "alone" for b in batches}
            for name, by in runs.items()}


def markdown(r: dict, conditions: list[str], batches: list[int]) -> str:
    m = r["machine"]
    lines = [f"# Decode beside other work ({r['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {r['settings']['rounds']} rounds, medians; "
             f"{r['settings']['new_tokens']} new tokens a stream.", "",
             "| target | " + " | ".join(f"{c} B={b} tok/s" for c in conditions for b in batches) + " |",
             "|---|" + "---|" * (len(conditions) * len(batches))]
    for name, by in r["medians"].items():
        cells = []
        for c in conditions:
            for b in batches:
                share = "" if c == "alone" else f" ({r['kept'][name][f'{c}_b{b}']:.0%})"
                cells.append(f"{by[f'{c}_b{b}']:.1f}{share}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    e = r["embeddings"]
    lines += ["", f"Embeddings (texts/s): alone {statistics.median(e['alone']):.1f}, beside 8 text streams "
              f"{statistics.median(e['beside_text_b8']):.1f} ({r['embeddings_kept']:.0%} kept, median of rounds).",
              "", "(%) = the median over rounds of the rate in that condition over the rate alone in the same round."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
