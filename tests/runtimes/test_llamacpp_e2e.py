"""One `inferd serve --config` with a deployment on llama.cpp's server (`runtime.engine: llama.cpp`,
llama-cpp-python's `llama_cpp.server` serving the packaged GGUF itself), called with the openai client: chat,
streams billed from the gateway's own count (its server streams no usage), requests beyond its one slot queued
by the gateway, and a killed replica replaced.

llama.cpp lives in its own environment, built from source (scripts/install-llamacpp.sh: 11-45 minutes on 2
cores, more than CI's budget): its python is $INFERD_LLAMACPP_PYTHON (default .venv-llamacpp/bin/python).
Without it these tests skip, in CI too, saying how to install it."""
import concurrent.futures
import os
from pathlib import Path

import openai
import pytest

from tests.runtimes.test_vllm_e2e import kill_and_wait_replaced, records
from tests.server import ROOT, server_process

KEY = "sk-llamacpp-e2e-key"
PYTHON = Path(os.environ.get("INFERD_LLAMACPP_PYTHON") or ROOT / ".venv-llamacpp" / "bin" / "python")
SPEC = """
deployments:
  - name: smol-llamacpp
    model: {{source: default}}
    runtime: {{engine: llama.cpp, python: "{python}", max_model_len: 2048, num_threads: 1}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not PYTHON.is_file():
        pytest.skip(f"llama.cpp's server is not installed at {PYTHON}: create it with scripts/install-llamacpp.sh "
                    "(it builds llama.cpp: 11-45 minutes) or name one in $INFERD_LLAMACPP_PYTHON")
    folder = tmp_path_factory.mktemp("llamacpp")
    (folder / "deploy.yaml").write_text(SPEC.format(python=PYTHON))
    log_path = folder / "serve.log"
    with server_process(log_path, "--config", str(folder / "deploy.yaml"), "--api-key", KEY,
                        startup_timeout_s=300) as (proc, url):
        yield proc, url, log_path


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_and_a_stream_billed_from_the_gateways_count(server):
    _, url, log_path = server
    api = client(url)
    r = api.chat.completions.with_raw_response.create(
        model="smol-llamacpp", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5, temperature=0)
    done = r.parse()
    assert done.choices[0].message.content and 1 <= done.usage.completion_tokens <= 5
    [record] = records(log_path, r.headers["x-request-id"])
    assert record["status"] == "completed" and record["model"] == "smol-llamacpp"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (done.usage.prompt_tokens,
                                                                      done.usage.completion_tokens)
    raw = api.chat.completions.with_raw_response.create(
        model="smol-llamacpp", messages=[{"role": "user", "content": "Count to 9."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, temperature=0)
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage  # the gateway's: llama.cpp streams none
    assert text and chunks[-1].choices == [] and 1 <= usage.completion_tokens <= 6
    [record] = records(log_path, raw.headers["x-request-id"])
    assert record["status"] == "completed" and record["ttft_s"] is not None
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert usage.prompt_tokens == api.chat.completions.create(  # the gateway counts the prompt as llama.cpp does
        model="smol-llamacpp", messages=[{"role": "user", "content": "Count to 9."}], max_tokens=1).usage.prompt_tokens


def test_requests_beyond_its_one_slot_wait_in_the_gateway_and_all_finish(server):
    _, url, _ = server
    api = client(url)

    def stream(i: int) -> str:
        chunks = api.chat.completions.create(model="smol-llamacpp", max_tokens=8, stream=True,
                                             messages=[{"role": "user", "content": f"Say {i} words."}])
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # its server would cut one stream short for another
        texts = list(pool.map(stream, range(3)))
    assert all(texts), texts


def test_a_killed_llamacpp_replica_is_replaced(server):
    proc, url, _ = server
    kill_and_wait_replaced(proc.pid, "llama_cpp.server", client(url), "smol-llamacpp", 200)
