"""placement.cpus: which CPUs each replica and the gateway get, the spec's checks, and real processes pinned."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.control.cpus import allocate, cpulist, machine_cpus, parse_cpulist
from inferd.control.launch import cpu_shares, spec_plans
from inferd.control.replicas import ReplicaProcess
from inferd.control.runtimes import threads_bind
from inferd.control.spec import SpecError, load_spec
from tests.server import ROOT

DEFAULTS = [("chat", "text", "auto"), ("minilm", "embedding", "auto"), ("iris", "classical", "auto"),
            ("reacher", "policy", "auto")]
TWO_TEXT = [("chat", "text", "auto"), ("chat2", "text", "auto"), ("minilm", "embedding", "auto")]


def shown(cpus: list[int] | None) -> str:
    return "all" if cpus is None else cpulist(cpus)


@pytest.mark.parametrize("machine, deployments, gateway, expected", [
    # the four default kinds
    ("0-1", DEFAULTS, "all", {"chat": "all", "minilm": "all", "iris": "all", "reacher": "all"}),
    ("0-3", DEFAULTS, "0", {"chat": "1-2", "minilm": "3", "iris": "0", "reacher": "0"}),
    ("0-7", DEFAULTS, "0", {"chat": "1-5", "minilm": "6-7", "iris": "0", "reacher": "0"}),
    ("0-15", DEFAULTS, "0", {"chat": "1-11", "minilm": "12-15", "iris": "0", "reacher": "0"}),
    ("0-63", DEFAULTS, "0", {"chat": "1-47", "minilm": "48-63", "iris": "0", "reacher": "0"}),
    ("8-15", DEFAULTS, "8", {"chat": "9-13", "minilm": "14-15", "iris": "8", "reacher": "8"}),  # taskset -c 8-15
    # two text deployments beside an embedding one
    ("0-1", TWO_TEXT, "all", {"chat": "all", "chat2": "all", "minilm": "all"}),
    ("0-3", TWO_TEXT, "0", {"chat": "1", "chat2": "2", "minilm": "3"}),
    ("0-7", TWO_TEXT, "0", {"chat": "1-3", "chat2": "4-6", "minilm": "7"}),
    ("0-15", TWO_TEXT, "0", {"chat": "1-7", "chat2": "8-13", "minilm": "14-15"}),
    ("0-63", TWO_TEXT, "0", {"chat": "1-27", "chat2": "28-54", "minilm": "55-63"}),
    # fewer CPUs than heavy deployments: they share what is left after the gateway's
    ("0-3", [(f"t{i}", "text", "auto") for i in range(4)], "0", {f"t{i}": "1-3" for i in range(4)}),
    # explicit lists are honoured; the auto ones split the rest
    ("0-7", [("chat", "text", "4-7"), ("minilm", "embedding", "auto"), ("iris", "classical", "auto")],
     "0", {"chat": "4-7", "minilm": "1-3", "iris": "0"}),
    ("0-7", [("chat", "text", "1-6"), ("minilm", "embedding", "auto"), ("iris", "classical", "auto")],
     "0", {"chat": "1-6", "minilm": "7", "iris": "0"}),
    ("0-7", [("chat", "text", "0-6"), ("minilm", "embedding", "auto")], "7", {"chat": "0-6", "minilm": "7"}),
    ("0-7", [("chat", "text", "0-7"), ("minilm", "embedding", "auto")], "all", {"chat": "0-7", "minilm": "all"}),
    ("0-1", [("chat", "text", "1"), ("minilm", "embedding", "auto")], "all", {"chat": "1", "minilm": "all"}),
    ("0-15", [("a", "text", "0-3"), ("b", "text", "2-5"), ("minilm", "embedding", "auto")],
     "6", {"a": "0-3", "b": "2-5", "minilm": "7-15"}),
    # only light kinds: they and the gateway on the first CPU
    ("0-7", [("iris", "classical", "auto")], "0", {"iris": "0"}),
    ("0-7", [], "all", {}),  # no local replicas (external deployments only): the gateway is not pinned
])
def test_allocation(machine, deployments, gateway, expected):
    shares = allocate(parse_cpulist(machine), deployments)
    assert shown(shares.gateway) == gateway
    assert {name: shown(cpus) for name, cpus in shares.deployments.items()} == expected
    assert list(shares.deployments) == [name for name, _, _ in deployments]


@pytest.mark.parametrize("text, cpus", [("0", [0]), ("0-3,6", [0, 1, 2, 3, 6]), ("6,0-1", [0, 1, 6]),
                                        ("2-2", [2]), ("0-1,1-2", [0, 1, 2]), (" 0 , 3-4 ", [0, 3, 4])])
def test_cpulists_parse_and_print(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(cpulist(cpus)) == cpus


def test_cpulist_prints_ranges():
    assert cpulist([0, 1, 2, 3, 6]) == "0-3,6" and cpulist([1, 3, 4, 5, 9]) == "1,3-5,9" and cpulist([]) == ""


@pytest.mark.parametrize("text, message", [("", "not a CPU list"), ("0-", "not a CPU list"), ("a", "not a CPU list"),
                                           ("0,,1", "not a CPU list"), ("-1", "not a CPU list"),
                                           ("1-0", "'1-0' is an empty range"), ("0-3;6", "not a CPU list"),
                                           ("٣", "not a CPU list")])
def test_bad_cpulists_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpulist(text)


@pytest.mark.parametrize("cpus, num_threads, bind", [
    (None, None, None), (None, 4, "0-3"), ([4, 5, 6, 7], None, "4-7"), ([4, 5, 6, 7], 2, "4-5"), ([1, 3], 2, "1,3"),
])
def test_vllm_binds_its_threads_to_its_cpus(cpus, num_threads, bind):
    assert threads_bind(cpus, num_threads) == bind


# the spec

SPEC = """
deployments:
  - name: chat
    model: {source: default}
    runtime: {num_threads: 1}
    placement: {cpus: "FIRST"}
  - name: minilm
    kind: embedding
    model: {source: default}
  - name: hosted
    external: {base_url: "https://api.example.com/v1"}
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text.replace("FIRST", str(machine_cpus()[0])))
    return path


def test_a_spec_pins_its_replicas(tmp_path):
    spec = load_spec(write(tmp_path, SPEC), verify_digests=False)
    chat, minilm, hosted = spec.deployments
    assert chat.placement.cpus == str(machine_cpus()[0]) and minilm.placement.cpus == "auto"
    shares, _ = cpu_shares(spec.deployments)
    assert list(shares.deployments) == ["chat", "minilm"]  # an external deployment has no replicas to pin
    plans = spec_plans(spec, cpus=shares.deployments)
    assert plans[0].replicas[0].cpus == [machine_cpus()[0]] == plans[0].make().cpus
    assert plans[1].replicas[0].cpus == shares.deployments["minilm"]
    number = load_spec(write(tmp_path, SPEC.replace('"FIRST"', "FIRST")), verify_digests=False)  # cpus: 0
    assert number.deployments[0].placement.cpus == str(machine_cpus()[0])


@pytest.mark.parametrize("edit, message", [
    (('cpus: "FIRST"', 'cpus: "0-"'), r"deployments\[0\].placement.cpus: '0-' is not a CPU list"),
    (('cpus: "FIRST"', 'cpus: "3-1"'), r"deployments\[0\].placement.cpus: '3-1' is an empty range"),
    (('cpus: "FIRST"', 'cpus: ""'), r"deployments\[0\].placement.cpus: '' is not a CPU list"),
    (('cpus: "FIRST"', 'cpus: "FIRST,4096"'), r"deployments\[0\].placement.cpus: no CPU 4096 here"),
    (('cpus: "FIRST"', 'cpus: [0]'), r"deployments\[0\].placement.cpus: expected str or int"),
    (('cpus: "FIRST"', 'cpus: "FIRST", backend: ray'), r"deployments\[0\].placement.cpus: only local replicas"),
    (('api.example.com/v1"}', 'api.example.com/v1"}\n    placement: {cpus: "FIRST"}'),
     r"deployments\[2\].placement.cpus: only local replicas"),
    (("num_threads: 1", "num_threads: 2"), r"deployments\[0\].placement.cpus: .* fewer than runtime.num_threads 2"),
])
def test_cpus_errors_name_the_field(tmp_path, edit, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, SPEC.replace(*edit)), verify_digests=False)


# real processes

def allowed_list(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_a_replica_runs_on_its_cpus():
    first = machine_cpus()[0]
    replica = ReplicaProcess(["--help"], cpus=[first])  # exits at once; its affinity is set before it runs
    replica.start()
    try:
        assert allowed_list(replica.proc.pid) == str(first)
    finally:
        replica.stop()
        replica.proc.wait()


PINNED_PARENT = """
import json, os, sys
from inferd.control.cpus import cpulist, machine_cpus
from inferd.control.replicas import ReplicaProcess
def allowed_list(pid):
    lines = open(f"/proc/{pid}/status").read().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Cpus_allowed_list"))
machine = machine_cpus()  # read before the pin, as `inferd serve` does
os.sched_setaffinity(0, machine[:1])
replica = ReplicaProcess(["--help"])
replica.start()
child = allowed_list(replica.proc.pid)
replica.proc.wait()
with open(sys.argv[1], "w") as f:
    json.dump({"parent": allowed_list(os.getpid()), "child": child, "machine": cpulist(machine)}, f)
"""


def test_a_replica_of_a_pinned_gateway_gets_all_cpus(tmp_path):
    if len(machine_cpus()) < 2:
        pytest.skip("one CPU: pinned and unpinned are the same")
    out = tmp_path / "out.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", PINNED_PARENT, str(out)], cwd=ROOT, env=env, check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    seen = json.loads(out.read_text())
    assert seen["parent"] == str(machine_cpus()[0])  # the parent pinned itself; its child was not left there
    assert seen["child"] == seen["machine"] == cpulist(machine_cpus())


def test_serve_logs_the_cpus_of_the_gateway_and_each_deployment(smollm2_server):
    _, log_path = smollm2_server
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    shares = [x["msg"] for x in lines if x["msg"].startswith("CPUs ")]
    assert len(shares) == 1 and shares[0].startswith(f"CPUs {cpulist(machine_cpus())}: gateway ")
    assert all(f"({kind})" in shares[0] for kind in ("text", "embedding", "classical", "policy")), shares[0]
