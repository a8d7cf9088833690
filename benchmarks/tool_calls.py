"""Tool calls that parse and validate: `inferd serve` against vLLM CPU on the same weights (SmolLM2-135M), in turn.

Each request offers 2-4 of six functions (enums, bounded integers, nested objects, arrays, required fields) and asks
something one of them answers. Both servers get the same prompt: inferd writes tools in its generic format
(protocol/tools.py), and vLLM is given a chat template (VLLM_TEMPLATE) that writes the same text, with its hermes
parser (`--enable-auto-tool-choice --tool-call-parser hermes`); the prompt token counts of both are reported to
show they match. For tool_choice "auto" and "required", at temperature 0 and 1:

  calls       tool calls returned
  valid       of those, calls whose name is an offered function and whose arguments parse as JSON and validate
              against its schema (jsonschema)
  answered    requests with at least one valid call (for "required" every request should be)
  text        requests answered in text (no call)

The grammar's step-time cost (inferd only): the same prompts streamed one at a time, tool_choice "required" against
the same number of tokens unconstrained (tool_choice "none", ignore_eos): seconds per output token after the first
(from the first event, the role's chunk sent with the first token, to the last).

    PYTHONPATH=. .venv/bin/python benchmarks/tool_calls.py --out benchmarks/results/tool-calls-<machine>.json
    PYTHONPATH=. .venv/bin/python benchmarks/tool_calls.py --servers inferd --busy --out ...  # beside a busy process
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import jsonschema

from benchmarks.embeddings import ROOT, started_server, stopped
from benchmarks.machine import describe
from inferd.control.runtimes import EngineChoice, RuntimeProcess
from inferd.engine.config import EngineConfig
from inferd.models.loader import default_model_path

KEY = "sk-bench-tools"
MODEL = "SmolLM2-135M-Instruct"
FUNCTIONS = {
    "get_weather": ("The current weather in a city.", {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 60}, "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    "convert_currency": ("Convert an amount of money between currencies.", {
        "type": "object", "additionalProperties": False, "required": ["amount", "from", "to"],
        "properties": {"amount": {"type": "number", "minimum": 0},
                       "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    "create_event": ("Put an event in the calendar.", {
        "type": "object", "additionalProperties": False, "required": ["title", "start"],
        "properties": {"title": {"type": "string", "maxLength": 80},
                       "start": {"type": "object", "additionalProperties": False, "required": ["day", "hour"],
                                 "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                "hour": {"type": "integer", "minimum": 0, "maximum": 23}}},
                       "attendees": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 40}}}}),
    "search_web": ("Search the web.", {
        "type": "object", "additionalProperties": False, "required": ["query"],
        "properties": {"query": {"type": "string", "maxLength": 100},
                       "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}}),
    "send_email": ("Send an email.", {
        "type": "object", "additionalProperties": False, "required": ["to", "subject", "body"],
        "properties": {"to": {"type": "string", "maxLength": 60}, "subject": {"type": "string", "maxLength": 80},
                       "body": {"type": "string", "maxLength": 200}}}),
    "set_timer": ("Start a countdown timer.", {
        "type": "object", "additionalProperties": False, "required": ["minutes"],
        "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                       "label": {"type": "string", "maxLength": 40}}}),
}
ASKS = [
    ("What's the weather in Lisbon today?", ["get_weather", "search_web"]),
    ("Is it cold in Oslo right now, in fahrenheit?", ["get_weather", "set_timer", "send_email"]),
    ("How many euros is 250 US dollars?", ["convert_currency", "get_weather"]),
    ("Convert 1200 JPY to GBP please.", ["convert_currency", "search_web", "set_timer"]),
    ("Book a team lunch on the 14th at 12 with Ana and Raj.", ["create_event", "send_email"]),
    ("Add 'dentist' to my calendar on day 3 at 9 o'clock.", ["create_event", "set_timer", "get_weather"]),
    ("Find recent news about the Mars rover.", ["search_web", "get_weather"]),
    ("Look up three recipes for lentil soup.", ["search_web", "send_email", "create_event"]),
    ("Email bob@example.com that the report is late.", ["send_email", "create_event"]),
    ("Tell alice@example.com the meeting moved to Friday.", ["send_email", "search_web", "set_timer"]),
    ("Set a timer for 25 minutes for my tea.", ["set_timer", "get_weather"]),
    ("Remind me in 90 minutes to stretch.", ["set_timer", "create_event", "send_email", "search_web"]),
]


def tool(name: str) -> dict:
    description, parameters = FUNCTIONS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# vLLM's chat template: SmolLM2's own, with tools written as inferd's generic format writes them
VLLM_TEMPLATE = r"""{%- if tools -%}
{%- set ns = namespace(listed='') -%}
{%- for t in tools -%}
{%- set ns.listed = ns.listed + ('\n' if not loop.first else '') + '{"name": ' + (t.function.name | tojson) + ', "description": ' + (t.function.description | tojson) + ', "parameters": ' + (t.function.parameters | tojson) + '}' -%}
{%- endfor -%}
{%- if tool_choice == 'required' -%}{%- set when = 'Answer with one or more calls.' -%}
{%- else -%}{%- set when = 'When a function helps, answer with calls only; otherwise answer in text.' -%}{%- endif -%}
{%- set text = 'You can call these functions:\n' + ns.listed + '\n\nTo call a function, write\n<tool_call>\n{"name": "<function name>", "arguments": <arguments as JSON>}\n</tool_call>\n' + when -%}
{{- '<|im_start|>system\n' + text + '<|im_end|>\n' -}}
{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}{%- endfor -%}
{%- else -%}
{%- for message in messages -%}{%- if loop.first and messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' -}}{%- endif -%}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}{%- endfor -%}
{%- endif -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def body(model: str, ask: str, names: list[str], choice: str, temperature: float, seed: int, vllm: bool) -> dict:
    out = {"model": model, "messages": [{"role": "user", "content": ask}], "tools": [tool(n) for n in names],
           "tool_choice": choice, "temperature": temperature, "seed": seed, "max_tokens": 256}
    if vllm:
        out["chat_template_kwargs"] = {"tool_choice": choice}
    return out


def judged(answer: dict, names: list[str]) -> dict:
    message, calls, valid, why = answer["choices"][0]["message"], 0, 0, []
    for call in message.get("tool_calls") or []:
        calls += 1
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if name not in names:
            why.append(f"{name!r} is not offered")
            continue
        try:
            jsonschema.validate(json.loads(arguments), FUNCTIONS[name][1])
            valid += 1
        except ValueError as exc:
            why.append(f"arguments are not JSON ({exc}): {arguments[:120]!r}")
        except jsonschema.ValidationError as exc:
            why.append(f"arguments do not validate ({exc.message[:100]}): {arguments[:120]!r}")
    return {"calls": calls, "valid": valid, "text": not calls, "prompt_tokens": answer["usage"]["prompt_tokens"],
            "finish_reason": answer["choices"][0]["finish_reason"], "why": why}


def sweep(url: str, key: str, model: str, vllm: bool, repeats: int, concurrency: int) -> dict:
    headers = {"authorization": f"Bearer {key}"}
    out = {}
    with httpx.Client(timeout=300, headers=headers) as http, ThreadPoolExecutor(concurrency) as pool:
        for choice in ("auto", "required"):
            for temperature in (0.0, 1.0):
                jobs = [(ask, names, seed) for seed in range(repeats if temperature else 1) for ask, names in ASKS]

                def one(job):
                    ask, names, seed = job
                    r = http.post(f"{url}/v1/chat/completions",
                                  json=body(model, ask, names, choice, temperature, seed, vllm))
                    if r.status_code != 200:
                        return {"error": r.status_code, "message": r.text[:300]}
                    return judged(r.json(), names)
                results = list(pool.map(one, jobs))
                ok = [r for r in results if "error" not in r]
                calls = sum(r["calls"] for r in ok)
                out[f"{choice}@t{temperature:g}"] = {
                    "requests": len(results), "errors": [r for r in results if "error" in r][:3],
                    "error_count": len(results) - len(ok), "calls": calls, "valid": sum(r["valid"] for r in ok),
                    "valid_share": round(sum(r["valid"] for r in ok) / calls, 4) if calls else None,
                    "answered_share": round(sum(1 for r in ok if r["valid"]) / len(results), 4),
                    "text_answers": sum(1 for r in ok if r["text"]),
                    "finish_reasons": {f: sum(1 for r in ok if r["finish_reason"] == f)
                                       for f in sorted({r["finish_reason"] for r in ok})},
                    "prompt_tokens": [r["prompt_tokens"] for r in ok[:len(ASKS)]],
                    "invalid_samples": [w for r in ok for w in r["why"]][:4]}
                print(model, out[f"{choice}@t{temperature:g}"] | {"prompt_tokens": "...", "invalid_samples": "..."},
                      flush=True)
    return out


def step_cost(url: str, key: str, rounds: int) -> dict:
    """Seconds per output token after the first, streamed one request at a time: constrained by the tools'
    grammar ("required") against as many tokens unconstrained ("none", ignore_eos)."""
    headers = {"authorization": f"Bearer {key}"}

    def per_token(payload: dict) -> tuple[float, int]:
        stamps, tokens = [], 0
        with httpx.Client(timeout=300, headers=headers) as http, http.stream(
                "POST", f"{url}/v1/chat/completions", json=payload | {
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                stamps.append(time.perf_counter())  # the first: the role's chunk, sent with the first token
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return (stamps[-1] - stamps[0]) / max(tokens - 1, 1), tokens
    constrained, free = [], []
    for r in range(rounds):
        for ask, names in ASKS:
            payload = body(MODEL, ask, names, "required", 0.0, r, False) | {"parallel_tool_calls": False}
            s, n = per_token(payload)
            f, _ = per_token(payload | {"tool_choice": "none", "max_tokens": n, "ignore_eos": True})
            constrained.append(s)
            free.append(f)
    c, f = statistics.median(constrained), statistics.median(free)
    return {"constrained_s_per_token_p50": round(c, 6), "free_s_per_token_p50": round(f, 6),
            "ratio": round(c / f, 3), "requests": len(constrained)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python",
                    default=os.environ.get("INFERD_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--servers", default="inferd,vllm")
    ap.add_argument("--busy", action="store_true", help="a CPU-bound Python process beside the servers throughout")
    ap.add_argument("--repeats", type=int, default=3, help="seeds per prompt at temperature 1")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--step-rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8981)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tool-calls-"))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"shared": ("a busy Python loop beside" if args.busy else "nothing else running")
                                       + "; the servers one after the other"},
              "settings": {k: v for k, v in vars(args).items() if k != "out"} | {  # no path of this machine
                  "vllm_python": os.path.relpath(args.vllm_python, ROOT)}, "servers": {}}
    command = [sys.executable, "-m", "inferd.cli", "serve", str(default_model_path()), "--port", str(args.port),
               "--api-key", KEY, "--db", f"sqlite:///{work / 'inferd.db'}", "--usage-journal",
               str(work / "usage.journal"), "--embedding-model", "none", "--classical-model", "none",
               "--policy-model", "none", "--log-level", "warning"]
    servers = args.servers.split(",")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        run(args, work, command, servers, result)
    finally:
        if busy is not None:
            busy.kill()
    print(json.dumps({k: v for k, v in result.items() if k != "servers"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace, work: Path, command: list[str], servers: list[str], result: dict) -> None:
    """Each server in turn: inferd's sweep and the grammar's step cost, then vLLM's sweep."""
    if "inferd" in servers:
        proc = started_server(command, f"http://127.0.0.1:{args.port}/ready", {"PYTHONPATH": str(ROOT)}, "tool-calls")
        try:
            url = f"http://127.0.0.1:{args.port}"
            result["servers"]["inferd"] = sweep(url, KEY, MODEL, False, args.repeats, args.concurrency)
            result["inferd_step_cost"] = step_cost(url, KEY, args.step_rounds)
            print(result["inferd_step_cost"], flush=True)
        finally:
            stopped(proc)
    if "vllm" in servers:
        template = work / "smollm2-tools.jinja"
        template.write_text(VLLM_TEMPLATE)
        vllm = RuntimeProcess(None, MODEL, EngineConfig(max_model_len=2048, max_num_seqs=64),
                              EngineChoice("vllm", args.vllm_python, [
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                  "--chat-template", str(template)]))
        vllm.start()
        try:
            vllm.wait_ready(1800)
            result["vllm_version"] = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                                    capture_output=True, text=True).stdout.strip()
            result["servers"]["vllm"] = sweep(vllm.url, vllm.api_key, MODEL, True, args.repeats, args.concurrency)
        finally:
            vllm.stop()


if __name__ == "__main__":
    main()
