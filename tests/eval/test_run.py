"""`inferd eval run` against the shared real server (one item of each behaviour), and `inferd eval compare`."""
import json
import subprocess
import sys

from inferd.eval.report import compare, parse_floor, report
from inferd.eval.run import ItemResult
from tests.conftest import SMOLLM2_KEY
from tests.server import ROOT


def eval_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.cli", "eval", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_eval_run_writes_its_reports_and_exits_1_below_the_floor(smollm2_server, tmp_path):
    url, _ = smollm2_server
    args = ("run", "--base-url", f"{url}/v1", "--api-key", SMOLLM2_KEY, "--model", "SmolLM2-135M-Instruct",
            "--split", "acceptance", "--limit", "1", "--concurrency", "3")
    done = eval_cli(*args, "--out", str(tmp_path / "a"), "--floor", "answer=0,decline=1")
    assert done.returncode == 1, done.stderr
    assert "below the floor: decline 0.0% [0.0%, 79.3%] is below the floor 100%" in done.stderr
    rep = json.loads((tmp_path / "a.json").read_text())
    assert [i["id"] for i in rep["items"]] == ["hr-02-answer", "hr-02-decline", "hr-02-conflict"]
    assert all(i["reply"] for i in rep["items"]) and rep["prompt_version"] == "docqa-v1/prompt-1"
    assert rep["summary"]["metrics"]["decline"]["n"] == 1 and set(rep["summary"]["domains"]) == {"hr"}
    md = (tmp_path / "a.md").read_text()
    assert "| decline | 0/1 |" in md and "## Items (failures first)" in md
    assert eval_cli(*args, "--out", str(tmp_path / "b"), "--floor", "answer=0").returncode == 0
    bad = eval_cli(*args, "--out", str(tmp_path / "c"), "--floor", "answr=0.2")
    assert bad.returncode == 2 and "answr" in bad.stderr


def result(item: str, passed: bool, behaviour: str = "answer") -> ItemResult:
    return ItemResult(item, behaviour, "hr", passed, "answered" if passed else "no accepted answer", None, "x", 0.1)


def test_compare_gives_deltas_with_intervals_and_the_flipped_items():
    meta = {"model": "m"}
    a = report(meta, [result(f"i{k}", True) for k in range(10)], {})
    b = report(meta, [result(f"i{k}", k < 2) for k in range(10)], {})
    c = compare(a, b)
    answer = c["deltas"]["answer"]
    assert answer["delta"] == -0.8 and answer["high"] < 0 < answer["low"] + 1
    assert [f["id"] for f in c["flipped"]] == [f"i{k}" for k in range(2, 10)] and c["common_items"] == 10
    assert parse_floor("answer=0.3, decline=0.5") == {"answer": 0.3, "decline": 0.5}
