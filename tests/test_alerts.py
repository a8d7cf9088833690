"""The alert rules (deploy/prometheus/alerts.yml): promtool checks them and runs their unit tests, every metric they
read is one a real `inferd serve` exports, every alert's runbook is a section of docs/runbooks.md, and a real
Prometheus scraping a real `inferd serve` fires the matching alerts through real faults (a full queue, a killed
replica, a stopped store)."""
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.conftest import SMOLLM2_KEY
from tests.gateway.services import OwnPostgres
from tests.server import ROOT, free_port, running_server

RULES = ROOT / "deploy" / "prometheus"
TLS_ONLY = {"inferd_gateway_tls_certificate_expiry_timestamp_seconds"}  # tests/gateway/test_tls_e2e.py reads it


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("INFERD_REQUIRE_SERVICES") == "1":
            pytest.fail("promtool is not installed (Debian's prometheus package)")
        pytest.skip("promtool is not installed (Debian's prometheus package)")
    return path


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    checked = subprocess.run([promtool(), "check", "rules", "alerts.yml"], cwd=RULES, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool(), "test", "rules", "alerts-test.yml"], cwd=RULES, capture_output=True,
                            text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested_and_has_its_runbook():
    tested = set(re.findall(r"alertname: (\w+)", (RULES / "alerts-test.yml").read_text()))
    headings = {line[3:].strip().lower() for line in (ROOT / "docs" / "runbooks.md").read_text().splitlines()
                if line.startswith("## ")}
    for rule in rules():
        assert rule["alert"] in tested, rule["alert"]
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "docs/runbooks.md" and anchor in headings, rule["alert"]


def test_the_rules_read_only_metrics_inferd_serve_exports(smollm2_server):
    """Each family the rules read is one /metrics declares (a labelled family with no sample yet has its TYPE)."""
    text = httpx.get(f"{smollm2_server[0]}/metrics").text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    read = {name for rule in rules() for name in re.findall(r"\binferd_[a-z_]+", rule["expr"])} - TLS_ONLY
    assert read and {name.removesuffix("_bucket") for name in read} <= families, read - families


def test_promtool_finds_nothing_to_say_of_metrics_after_traffic(smollm2_server):
    url = smollm2_server[0]
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {SMOLLM2_KEY}"}, json=chat, timeout=60)
    httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer sk-not-a-key-at-all"}, json={})
    linted = subprocess.run([promtool(), "check", "metrics"], input=httpx.get(f"{url}/metrics").text,
                            capture_output=True, text=True)
    said = linted.stdout + linted.stderr
    assert linted.returncode == 0 and not said.strip(), said


def test_real_faults_fire_their_alerts_in_a_real_prometheus_scraping_inferd_serve(tmp_path):
    """Debian's Prometheus scrapes a real `inferd serve`, whose store is a PostgreSQL of the test's own, through
    three real faults in turn, each until its alert fires:

    - a flood overruns its one slot and one queue place: InferdRefusingForCapacity;
    - its one replica is killed: InferdNoReadyReplica, while the pool starts another;
    - the store is stopped under traffic: InferdUsageRecordsSpilling (the records wait in the journal).

    The rules are alerts.yml's on a fast clock, each `for:` at 0 s and each rate's window 15 s (promtool's unit
    tests hold the real ones; a rate over 5 minutes of a series a few seconds old reads far below its pace)."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        promtool()  # fails in CI, skips elsewhere, with the same reason
        pytest.skip("prometheus is not installed")
    fast = re.sub(r"\n(\s+)for: \d+m\n", r"\n\1for: 0s\n", (RULES / "alerts.yml").read_text())
    fast = re.sub(r"\[\d+[mh]\]", "[15s]", fast)
    (tmp_path / "alerts.yml").write_text(fast)
    store = OwnPostgres()
    store.start()
    log = tmp_path / "serve.log"
    try:
        with running_server(log, "--api-key", SMOLLM2_KEY, "--max-inflight", "1", "--max-queue-len", "1",
                            "--db", store.url) as url:
            port = free_port()
            target = {"job_name": "inferd", "static_configs": [{"targets": [url.removeprefix("http://")]}]}
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["alerts.yml"],
                "scrape_configs": [target]}))
            proc = subprocess.Popen([prometheus, "--config.file=prometheus.yml",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                    cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            prom = f"http://127.0.0.1:{port}"
            try:
                full = flood_until_firing(url, prom, "InferdRefusingForCapacity")
                assert full["labels"]["reason"] == "queue_full" and full["labels"]["severity"] == "warning"
                assert full["annotations"]["runbook_url"] == "docs/runbooks.md#inferdrefusingforcapacity"

                [replica] = re.findall(r"started replica pid (\d+)", log.read_text())
                os.kill(int(replica), signal.SIGKILL)
                down = until_firing(prom, "InferdNoReadyReplica")
                assert down["labels"]["severity"] == "page", down
                until_answered(url)  # the pool's new replica

                store.stop()
                spilling = flood_until_firing(url, prom, "InferdUsageRecordsSpilling")
                assert spilling["annotations"]["runbook_url"] == "docs/runbooks.md#inferdusagerecordsbacklog"
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        store.remove()


def until_firing(prometheus: str, alert: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fired := firing(prometheus, alert):
            return fired
        time.sleep(0.5)
    pytest.fail(f"{alert} did not fire within {timeout_s} s")


def until_answered(url: str, timeout_s: float = 180) -> None:
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {SMOLLM2_KEY}"},
                       timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.5)
    pytest.fail(f"no answer within {timeout_s} s of the replica's death")


def firing(prometheus: str, alert: str) -> dict | None:
    try:
        alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    except (httpx.HTTPError, ValueError):
        return None  # Prometheus is still starting
    return next((a for a in alerts if a["labels"]["alertname"] == alert and a["state"] == "firing"), None)


def flood_until_firing(url: str, prometheus: str, alert: str, timeout_s: float = 180) -> dict:
    """Chat requests 8 at a time (each holds the slot for 32 tokens) until Prometheus says the alert fires."""
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to 50."}],
            "max_tokens": 32, "ignore_eos": True}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {SMOLLM2_KEY}"}) as http, \
            ThreadPoolExecutor(8) as pool:
        while time.monotonic() < deadline:
            list(pool.map(lambda _: http.post(f"{url}/v1/chat/completions", json=chat), range(8)))
            if fired := firing(prometheus, alert):
                return fired
    pytest.fail(f"{alert} did not fire within {timeout_s} s")


def test_the_grafana_dashboard_reads_only_series_inferd_serve_exports(smollm2_server):
    """deploy/grafana/inferd.json: valid JSON whose every query names series /metrics has (a family declared by its
    TYPE line counts for one with no sample yet), each panel with a unit and the model variable's query too."""
    import json
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "inferd.json").read_text())
    url = smollm2_server[0]
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {SMOLLM2_KEY}"}, json=chat, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    series = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    read = {name for q in queries for name in re.findall(r"\binferd_[a-z_]+", q)}
    unknown = {n for n in read if n not in series and n.removesuffix("_bucket") not in families}
    assert len(queries) >= 15 and not unknown, unknown
    assert all(p["fieldConfig"]["defaults"]["unit"] for p in dashboard["panels"])


def test_promtool_parses_every_query_of_the_grafana_dashboard(tmp_path):
    """Each panel's query, Grafana's variables set as Grafana would, checked by promtool as a recording rule."""
    import json
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "inferd.json").read_text())
    exprs = [t["expr"].replace("$__rate_interval", "5m").replace("$model", ".*")
             for p in dashboard["panels"] for t in p["targets"]]
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    checked = subprocess.run([promtool(), "check", "rules", "dashboard.yml"], cwd=tmp_path, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
