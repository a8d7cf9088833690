"""Served decode beside other work: `inferd serve` and vLLM CPU in turn, each alone, beside a busy process and
beside another model kind under load; and the other kinds beside text decode. One table.

Targets (started once, taking turns in every round, each round starting one further along, so that the machine's
drift and the order fall on all):
  serve:<fmt>  one `inferd serve --config` with a text deployment per format (served_decode.py's formats: e.g.
               auto:none, the default; auto:none+num_threads=1; auto:none+adapt_threads=false, the engine before
               it followed the free cores) and the default embedding, classical and policy deployments
               (all-MiniLM-L6-v2, iris-classifier, reacher-bc)
  vllm         vLLM CPU's own server on the same weights, started as inferd's vLLM runtime starts it
Conditions:
  alone   nothing else runs
  busy    one Python busy loop (a CPU-bound neighbour)
  embed   a client keeps inferd's embedding model busy (256 texts of ~40 tokens a request, one after another)
  classical, policy   clients keep the classical model (single rows) or the robot policy busy (KIND_CLIENT)
Decode tok/s at --batches streams (served_decode.py's light client and window); each condition's rate over the
same target's rate alone in the same round; medians over rounds. Then each of --kinds alone and beside 8 streams of
the first text target (the reverse of its condition).

    PYTHONPATH=. .venv/bin/python benchmarks/neighbours.py --out benchmarks/results/neighbours.json
    PYTHONPATH=. .venv/bin/python benchmarks/neighbours.py --formats auto:none --vllm-python none \
        --conditions alone,classical,policy --kinds classical,policy --out benchmarks/results/neighbours-kinds.json
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
from benchmarks.machine import ROOT, cpu_name, loadavg
from benchmarks.served_decode import (KEY, SETTINGS, Served, deployment_name, quiet, serve_spec,
                                      start_serve, streams)
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.engine.config import EngineConfig
from inferd.classical.demo import DEMO_NAME as CLASSICAL_NAME
from inferd.models.sentence import DEFAULT_EMBEDDING_NAME
from inferd.policy.demo import DEMO_NAME as POLICY_NAME

CONDITIONS = ("alone", "busy", "embed")  # also "classical" and "policy": those kinds' clients under load
KINDS = ("embed", "classical", "policy")  # the other kinds of the same `inferd serve`, each with a client below
BUSY = "while True: pass"
# Another kind's client in a process of its own (its work is not the decode client's), --workers of them in threads,
# each a request after another: units a second (texts, predictions, observations answered) after its first second.
# embed: 256 texts of ~40 tokens a request; classical: one row of the demo classifier a request; policy: one
# observation of the demo reacher a call, over openpi's WebSocket client, each worker a session of its own.
KIND_CLIENT = """
import sys, threading, time
kind, url, key, seconds, workers = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
start, end = time.monotonic() + 1.0, time.monotonic() + seconds
done = [0] * workers

def embed(i):
    import httpx
    texts = [f"{i} {n} " + "the quick brown fox jumps over the lazy dog " * 4 for n in range(256)]
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < end:
            c.post(f"{url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts},
                   headers={"authorization": f"Bearer {key}"}).raise_for_status()
            done[i] += len(texts) if time.monotonic() > start else 0

def classical(i):
    import httpx
    row = {"sepal_length_cm": 5.1, "sepal_width_cm": 3.5, "petal_length_cm": 1.4, "petal_width_cm": 0.2}
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < end:
            c.post(f"{url}/v1/predict", json={"model": "iris-classifier", "inputs": [row]},
                   headers={"authorization": f"Bearer {key}"}).raise_for_status()
            done[i] += time.monotonic() > start

def policy(i):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from inferd.policy.sim import ReacherTask
    robot = ReacherTask(seed=i)
    client = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/policies/reacher-bc/ws", api_key=key)
    while time.monotonic() < end:
        if robot.steps >= 50:
            robot.reset(robot.steps + i)
        robot.step(client.infer(robot.observation())["actions"][0])
        done[i] += time.monotonic() > start
    client._ws.close()  # openpi's client has no close of its own

threads = [threading.Thread(target=globals()[kind], args=(i,)) for i in range(workers)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sum(done) / max(time.monotonic() - start, 1e-9))
"""
WORKERS = {"embed": 1, "classical": 4, "policy": 4}


def kind_client(kind: str, url: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", KIND_CLIENT, kind, url, KEY, str(seconds), str(WORKERS[kind])],
                            stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})


def units_per_s(client: subprocess.Popen) -> float:
    out, _ = client.communicate(timeout=600)
    if client.returncode != 0:
        raise RuntimeError("a neighbouring kind's client failed")
    return round(float(out.strip()), 1)


def decode_beside(target: Served, condition: str, batch: int, seed: int, vocab: int, new_tokens: int,
                  embed_url: str) -> float:
    neighbour = None
    if condition == "busy":
        neighbour = subprocess.Popen([sys.executable, "-c", BUSY])
    elif condition in KINDS:
        neighbour = kind_client(condition, embed_url, 3600)
    try:
        if neighbour is not None:
            time.sleep(1.5)  # the neighbour is running (and the engine has seen it)
        return round(target.decode(batch, seed, vocab, new_tokens), 1)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def kind_beside_decode(kind: str, url: str, text: Served, seconds: float, vocab: int, seed: int) -> float:
    """A kind's client's units/s while 8 text streams decode (they run longer than the client)."""
    async def both() -> float:
        prompts = random_prompts(8, PROMPT_LEN, vocab, seed=seed)
        decode = asyncio.ensure_future(streams(text.url, text.key, text.model, prompts, 2048, text.client))
        await asyncio.sleep(1.5)
        client = kind_client(kind, url, seconds)
        rate = await asyncio.to_thread(units_per_s, client)
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
    ap.add_argument("--kinds", default="embed", help="the other kinds whose rate is measured alone and beside 8 text "
                    "streams (embed, classical, policy)")
    ap.add_argument("--embed-seconds", type=float, default=8.0, help="each such measure's length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    formats, batches = args.formats.split(","), [int(b) for b in args.batches.split(",")]
    conditions = args.conditions.split(",")
    vocab = 49152
    work = Path(tempfile.mkdtemp(prefix="neighbours-"))
    kinds = [k for k in args.kinds.split(",") if k]
    spec = serve_spec(formats) + (f"  - name: {DEFAULT_EMBEDDING_NAME}\n    kind: embedding\n"
                                  "    model: {source: default}\n"
                                  f"  - name: {CLASSICAL_NAME}\n    kind: classical\n    model: {{source: default}}\n"
                                  f"  - name: {POLICY_NAME}\n    kind: policy\n    model: {{source: default}}\n")
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
        for kind in set(kinds) | {c for c in conditions if c in KINDS}:
            units_per_s(kind_client(kind, url, 2.0))  # warm-up
        runs = {t.name: {f"{c}_b{b}": [] for c in conditions for b in batches} for t in targets}
        kind_runs = {k: {"alone": [], "beside_text_b8": []} for k in kinds}
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
            for kind in kinds:
                quiet()
                kind_runs[kind]["alone"].append(units_per_s(kind_client(kind, url, args.embed_seconds)))
                quiet()
                seed += 1
                kind_runs[kind]["beside_text_b8"].append(kind_beside_decode(kind, url, targets[0], args.embed_seconds,
                                                                            vocab, seed))
                print(f"round {r} {kind}: {json.dumps({k: v[-1] for k, v in kind_runs[kind].items()})}",
                      file=sys.stderr, flush=True)
    finally:
        for stop in reversed(stops):
            stop()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "load_average_after": loadavg()},
              "settings": SETTINGS | {"formats": formats, "new_tokens": args.new_tokens, "rounds": args.rounds},
              "runs": runs, "kinds": kind_runs,
              "medians": {n: {k: statistics.median(v) for k, v in by.items()} for n, by in runs.items()},
              "kept": kept(runs, conditions, batches),
              "kinds_kept": {k: statistics.median(b / a for a, b in zip(by["alone"], by["beside_text_b8"]))
                             for k, by in kind_runs.items()}}
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
    units = {"embed": "texts/s", "classical": "single-row predictions/s", "policy": "observations answered/s"}
    lines.append("")
    for kind, by in r["kinds"].items():
        lines.append(f"- {kind} ({units[kind]}, {WORKERS[kind]} client worker(s)): alone "
                     f"{statistics.median(by['alone']):.1f}, beside 8 text streams "
                     f"{statistics.median(by['beside_text_b8']):.1f} ({r['kinds_kept'][kind]:.0%} kept, median of rounds).")
    lines += ["", "(%) = the median over rounds of the rate in that condition over the rate alone in the same round."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
