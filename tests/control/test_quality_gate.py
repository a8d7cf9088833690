"""The quality set as a release rule, through a real `inferd serve --config`: a worse candidate (a tiny
random-weight model, save_tiny_model) is refused by the release gate, as a canary and as a stable version, and
a canary without a floor is rolled back because it is worse than the stable version on the set beyond the
interval.

The set is four of docqa-v1's acceptance answer items that SmolLM2-135M-Instruct answers (evals/results/), so
stable scores 4/4 and the tiny model 0/4: Newcombe's interval for the difference, [-100%, -31%], is below 0.
"""
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.models.test_hf import save_tiny_model
from tests.server import ROOT, db_url, free_port, running_server

KEY = "sk-quality-test-key"
ADMIN = "quality-admin-key"
SET = ROOT / "evals" / "docqa-v1"
ITEMS = ("software-02-answer", "software-05-answer", "software-06-answer", "clinic-06-answer")
RUNTIME = "{dtype: float32, max_num_seqs: 4, max_model_len: 1024, kv_cache_gib: 0.05, num_threads: 1}"
GATED = "{set: SET, floor: {answer: 0.5}}"
CONFIG = f"""
deployments:
  - name: docs
    model: {{source: default}}
    runtime: {RUNTIME}
    quality: {GATED}
  - name: docs
    version: v2
    role: canary
    model: {{source: TINY}}
    runtime: {RUNTIME}
    quality: {GATED}
  - name: notes
    model: {{source: default}}
    runtime: {RUNTIME}
    quality: {GATED}
  - name: notes
    version: v2
    role: canary
    model: {{source: TINY}}
    runtime: {RUNTIME}
    quality: {{set: SET}}
    rollout: {{weight: 0.5, min_requests: 1000}}
"""


def small_set(folder):
    """docqa-v1's prompt and the chosen items, as a set of its own."""
    folder.mkdir()
    (folder / "prompt.json").write_text((SET / "prompt.json").read_text())
    lines = [line for line in (SET / "items.jsonl").read_text().splitlines() if json.loads(line)["id"] in ITEMS]
    (folder / "items.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_and_set(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    save_tiny_model(tmp / "tiny", max_position_embeddings=1024)
    return tmp, tmp / "tiny", small_set(tmp / "set")


@pytest.fixture(scope="module")
def served(tiny_and_set):
    tmp, tiny, subset = tiny_and_set
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG.replace("SET", str(subset)).replace("TINY", str(tiny)))
    log_path = tmp / "serve.log"
    with running_server(log_path, "--config", str(config), "--api-key", KEY, "--admin-key", ADMIN) as url:
        yield url, log_path


def admin(url: str, method: str, path: str) -> httpx.Response:
    return httpx.request(method, f"{url}/admin/rollouts{path}", timeout=30,
                         headers={"authorization": f"Bearer {ADMIN}"})


def test_the_gate_refuses_a_worse_canary_and_the_stable_version_serves(served):
    url, log_path = served
    status = admin(url, "GET", "/docs").json()
    assert status["state"] == "refused" and status["decision"]["by"] == "release gate", status
    assert status["decision"]["reasons"][0].startswith("release gate: answer 0.0% [0.0%, 49.0%] is below the "
                                                       "floor 50%"), status
    assert status["versions"]["v2"]["replicas_alive"] == 0
    assert "release gate: canary docs v2 refused: answer 0.0%" in log_path.read_text()
    assert "release gate: docs v1 on set acceptance (4 items" in log_path.read_text()
    again = admin(url, "POST", "/docs/start")
    assert again.status_code == 400 and again.json()["error"]["code"] == "invalid_rollout_state"
    body = {"model": "docs", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200


def test_a_canary_worse_on_the_set_is_rolled_back_without_waiting_for_traffic(served):
    url, _ = served
    assert admin(url, "POST", "/notes/start").status_code == 200
    deadline = time.monotonic() + 60
    while (status := admin(url, "GET", "/notes").json())["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert status["state"] == "rolled_back" and status["decision"]["by"] == "auto", status
    assert status["decision"]["reasons"] == ["quality answer 0% vs 100%: -100% [-100%, -31%]",
                                             "quality overall 0% vs 100%: -100% [-100%, -31%]"], status
    assert status["versions"]["v2"]["quality"]["metrics"]["answer"]["passed"] == 0
    assert status["versions"]["v1"]["quality"]["metrics"]["answer"]["passed"] == 4
    assert status["versions"]["v2"]["requests"] == 0  # decided on the set, before any canary traffic


def test_a_stable_version_below_its_floor_does_not_start(tiny_and_set):
    tmp, tiny, subset = tiny_and_set
    config = tmp / "refused.yaml"
    config.write_text(f"deployments:\n  - name: worse\n    model: {{source: {tiny}}}\n    runtime: {RUNTIME}\n"
                      f"    quality: {GATED.replace('SET', str(subset))}\n")
    log_path = tmp / "refused.log"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--config", str(config), "--port", str(free_port()),
           "--db", db_url(log_path), "--usage-journal", str(tmp / "refused.journal")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "release gate: worse v1 does not start: answer 0.0% [0.0%, 49.0%] is below the floor 50%" in done.stderr
