"""Autoscaling end to end: `inferd serve --config` with a pool per deployment, driven by `inferd bench`.

A step of load on `chat` (min 1, max 2) starts a second replica that joins routing; when the load stops it
is drained and stopped. `lazy` (min 0, scale_to_zero) has no replica until a request waits for one.
"""
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ROOT, running_server

KEY = "sk-autoscale-test"
HEADERS = {"authorization": f"Bearer {KEY}"}
SPEC = """
deployments:
  - name: chat
    model: {source: default}
    runtime: &runtime {dtype: float32, max_num_seqs: 2, max_num_batched_tokens: 128, kv_cache_gib: 0.05,
                       max_model_len: 256, num_threads: 1}
    replicas: 1
    router: {policy: least_loaded}  # prefix affinity would keep the shared prompt prefix on chat-0
    autoscaling: {min_replicas: 1, max_replicas: 2, target_ttft_ms: 300, target_queue_age_ms: 300,
                  upscale_delay_s: 1, downscale_delay_s: 2, drain_timeout_s: 10, interval_s: 0.5, window_s: 3}
  - name: lazy
    model: {source: default}
    runtime: *runtime
    replicas: 0
    autoscaling: {min_replicas: 0, max_replicas: 1, scale_to_zero: true, downscale_delay_s: 2, interval_s: 0.5}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoscale")
    (folder / "deploy.yaml").write_text(SPEC)
    log_path = folder / "serve.log"
    with running_server(log_path, "--config", str(folder / "deploy.yaml"), "--api-key", KEY) as url:
        yield url, log_path


def metric(url: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def replicas(url: str, deployment: str, state: str) -> float | None:
    return metric(url, "inferd_deployment_replicas", deployment=deployment, state=state)


def wait_for(check, timeout_s: float, what: str, log_path) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what} not within {timeout_s} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.25)
    return time.monotonic() - start


def completed(url: str) -> float:
    return metric(url, "inferd_gateway_requests_total", model="chat", status="completed") or 0.0


def chat(url: str, model: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=HEADERS | headers, timeout=320,
                      json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def test_a_load_step_scales_up_and_the_extra_replica_drains_when_it_stops(server, tmp_path):
    url, log_path = server
    assert replicas(url, "chat", "ready") == 1
    phases = {p: metric(url, "inferd_replica_cold_start_seconds", deployment="chat", phase=p)
              for p in ("weights_loaded", "warm", "ready")}
    assert 0 < phases["weights_loaded"] < phases["warm"] <= phases["ready"], phases

    before = completed(url)
    bench = subprocess.Popen(  # the step: from idle to 4 requests at a time (2 fit on one replica), until killed
        [sys.executable, "-m", "inferd.cli", "bench", "run", "--base-url", f"{url}/v1", "--api-key", KEY,
         "--model", "chat", "--arrival", "closed", "--concurrency", "4", "--duration-s", "600", "--num-requests",
         "300", "--input-tokens", "32", "--output-tokens", "8", "--warmup-requests", "0",
         "--max-client-lag-ms", "100000", "--no-progress", "--no-html", "--out", str(tmp_path / "step")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # generous timeouts: on a busy 2-core machine bench and a replica each take a minute to start
        decided_s = wait_for(lambda: "chat: 1 -> 2 replicas (" in log_path.read_text(), 300, "a scale-up", log_path)
        ready_s = wait_for(lambda: replicas(url, "chat", "ready") == 2, 300, "a second chat replica", log_path)
        print(f"scale-up decided {decided_s:.1f} s after bench started, second replica ready {ready_s:.1f} s later")
        wait_for(lambda: (metric(url, "inferd_requests_total", replica="chat-1", finish_reason="length") or 0) >= 2
                 and metric(url, "inferd_autoscaler_signal", deployment="chat", signal="queue_age_seconds") < 0.3,
                 60, "chat-1 serving and the queue back under its target", log_path)
        assert bench.poll() is None, "bench stopped early"
    finally:
        bench.terminate()
        bench.wait(timeout=30)
    assert completed(url) - before >= 4
    assert metric(url, "inferd_gateway_requests_total", model="chat", status="failed") is None

    wait_for(lambda: replicas(url, "chat", "ready") == 1 and replicas(url, "chat", "draining") == 0
             and "replica chat-1 drained and stopped" in log_path.read_text(), 60,
             "the extra replica drained and stopped", log_path)
    assert chat(url, "chat").status_code == 200


def test_scale_to_zero_the_first_request_waits_for_a_replica(server):
    url, log_path = server
    assert replicas(url, "lazy", "ready") == 0 and replicas(url, "lazy", "starting") == 0
    start = time.monotonic()
    r = chat(url, "lazy", **{"x-inferd-deadline-ms": "300000"})
    waited = time.monotonic() - start
    assert r.status_code == 200, r.text
    print(f"first request on a deployment scaled to zero took {waited:.1f} s")
    phases = {p: metric(url, "inferd_replica_cold_start_seconds", deployment="lazy", phase=p)
              for p in ("weights_loaded", "warm", "ready", "estimate")}
    print("cold start", phases)
    assert 0 < phases["weights_loaded"] < phases["warm"] <= phases["ready"] == phases["estimate"] < waited + 1
    wait_for(lambda: replicas(url, "lazy", "ready") == 0 and replicas(url, "lazy", "draining") == 0, 60,
             "lazy back to zero replicas", log_path)
