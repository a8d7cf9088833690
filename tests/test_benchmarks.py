"""The benchmark harness: `python -m benchmarks` lists the scenarios and runs one by its name."""
import subprocess
import sys

from tests.server import ROOT


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_the_list_names_each_scenario_with_what_it_measures():
    done = harness("--list")
    rows = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert done.returncode == 0 and {"burst", "tool_calls", "served_decode", "overload"} <= set(rows)
    assert "machine" not in rows and "venvs" not in rows  # helpers, not scenarios
    assert all(line.strip() for line in rows.values())


def test_a_scenario_runs_by_its_name_and_an_unknown_one_is_one_line():
    done = harness("burst", "--help")
    assert done.returncode == 0 and "--rounds" in done.stdout
    unknown = harness("nope")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "--list" in unknown.stderr
