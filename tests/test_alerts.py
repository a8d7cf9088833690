"""The alert rules (deploy/prometheus/alerts.yml): promtool checks them and runs their unit tests, every metric they
read is one a real `inferd serve` exports, and every alert's runbook is a section of docs/runbooks.md."""
import os
import re
import shutil
import subprocess

import httpx
import pytest
import yaml

from tests.conftest import SMOLLM2_KEY
from tests.server import ROOT

RULES = ROOT / "deploy" / "prometheus"


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
    read = {name for rule in rules() for name in re.findall(r"\binferd_[a-z_]+", rule["expr"])}
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
