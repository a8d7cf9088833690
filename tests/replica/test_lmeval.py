"""Scoring by likelihood through the real `inferd serve` (SmolLM2, float32): /v1/completions' echo with
logprobs, /tokenize and /detokenize through the gateway, and lm-eval's `local-completions` on the local
multiple-choice task (evals/lm-eval/), its accuracy checked against transformers' logprobs on the same tokens."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from inferd.models.loader import default_model_path, load_tokenizer
from tests.conftest import SMOLLM2_KEY as API_KEY, SMOLLM2_MAX_MODEL_LEN as MAX_MODEL_LEN

ROOT = Path(__file__).parents[2]
TASK_DIR = ROOT / "evals" / "lm-eval"
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def url(smollm2_server) -> str:
    return smollm2_server[0]


@pytest.fixture(scope="module")
def model(url) -> str:
    return httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def completions(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each token after the first."""
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


# echo

def test_echo_token_id_prompts_return_every_prompt_token_with_its_logprob(url, model, tokenizer, hf):
    prompts = [tokenizer.encode("The quick brown fox jumps over the lazy dog."), tokenizer.encode("Hello there")]
    r = completions(url, model=model, prompt=prompts, max_tokens=1, logprobs=2, echo=True, temperature=0)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one sampled token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert "".join(lp["tokens"][:len(ids)]) == tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False))
        ref = hf_logprobs(hf, ids)
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(ref.tolist(), abs=1e-4)
        assert all(len(top) <= 2 and max(top.values()) >= t - 1e-6
                   for t, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
    assert r.json()["usage"]["completion_tokens"] == 2


def test_echo_with_max_tokens_0_is_the_prompt_alone(url, model, tokenizer):
    text = "Paris is the capital of France"
    r = completions(url, model=model, prompt=text, max_tokens=0, logprobs=0, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode(text))
    assert body["usage"]["completion_tokens"] == 0
    plain = completions(url, model=model, prompt=text, max_tokens=0, echo=True).json()["choices"][0]
    assert plain["text"] == text and plain["logprobs"] is None


@pytest.mark.parametrize("fields, param", [
    (dict(echo=True, stream=True, logprobs=1), "echo"),
    (dict(echo=True, n=2, logprobs=1), "echo"),
    (dict(echo=True, logprobs=6), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt=[[1, 2], [3, 49152]], echo=True, logprobs=1), "prompt"),
])
def test_bad_echo_requests_get_400_in_openai_shape(url, model, fields, param):
    r = completions(url, **({"model": model, "prompt": "Hi", "max_tokens": 1} | fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


# tokenize

def test_tokenize_and_detokenize_through_the_gateway(url, model, tokenizer):
    text = "Tokens, please: naïve café"
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": tokenizer.encode(text), "count": len(tokenizer.encode(text)),
                        "max_model_len": MAX_MODEL_LEN}
    back = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, headers=AUTH)  # model: the default
    assert back.status_code == 200 and back.json() == {"prompt": text}
    info = httpx.get(f"{url}/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template


def test_tokenize_routes_are_authenticated_and_check_their_input(url, model):
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{url}/tokenizer_info").status_code == 401
    r = httpx.post(f"{url}/detokenize", json={"tokens": [49152]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{url}/tokenize", json={"model": "no-such-model", "prompt": "x"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# lm-eval

def test_lm_eval_accuracy_equals_the_one_from_transformers_logprobs(url, model, tokenizer, hf, tmp_path):
    pytest.importorskip("lm_eval")
    env = os.environ | {"OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                        "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,auth_token={API_KEY},"
            f"max_length={MAX_MODEL_LEN},num_concurrent=2,max_retries=1")
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "inferd_mc", "--include_path", str(TASK_DIR), "--output_path",
                           str(tmp_path / "out"), "--log_samples"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = tmp_path.glob("out/**/results_*.json")
    (samples,) = tmp_path.glob("out/**/samples_inferd_mc_*.jsonl")
    accuracy = json.loads(results.read_text())["results"]["inferd_mc"]["acc,none"]
    items = [json.loads(line) for line in (TASK_DIR / "inferd_mc.jsonl").read_text().splitlines()]
    ours, right = [json.loads(line) for line in samples.read_text().splitlines()], 0
    for doc in items:
        scores = [continuation_logprob(hf, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
        (logged,) = [s for s in ours if s["doc"]["question"] == doc["question"]]
        assert [float(r[0]) for r in logged["filtered_resps"]] == pytest.approx(scores, abs=1e-3)
    assert len(ours) == len(items) == 12
    assert accuracy == pytest.approx(right / len(items))


def continuation_logprob(hf, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by transformers, tokenized as lm-eval does (the pair encoded whole, the
    context's tokens split off; no special tokens)."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(tokenizer.encode(context, add_special_tokens=False))
    return hf_logprobs(hf, whole)[n - 1:].sum().item()
