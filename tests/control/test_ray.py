"""Ray placement: `inferd serve --config` runs its replica as a Ray actor on a real local Ray cluster started here."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group

from inferd.control.placement import make_replica
from inferd.control.ray_placement import RayReplica
from inferd.control.spec import PlacementSpec
from tests.server import free_port, running_server

KEY = "sk-ray-test"


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray head with 2 CPUs and no GPU in its own process group; killed with its group at the end."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    address = f"127.0.0.1:{free_port()}"
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--port", address.split(":")[1],
           "--num-cpus", "2", "--num-gpus", "0", "--temp-dir", temp, "--include-dashboard=false",
           "--disable-usage-stats"]
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # gcs_server, raylet, agents and workers stay in its session
    try:
        out, _ = head.communicate(timeout=60)
        assert head.returncode == 0, out[-3000:]
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        yield address
    finally:
        ray.shutdown()
        kill_session(head.pid)
        shutil.rmtree(temp, ignore_errors=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of the head's session: gcs_server, raylet, agents and the workers (own groups)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # state, ppid, pgrp, session
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError):
            pass


def deploy_yaml(tmp_path: Path, placement: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""deployments:
  - name: smol
    model: {{source: default}}
    runtime: {{max_num_seqs: 4, kv_cache_gib: 0.1, max_model_len: 512}}
    replicas: 1
    placement: {placement}
""")
    return path


def replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "inferd" and a["name"].startswith("inferd-replica-")]


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_serve_runs_its_replica_as_a_ray_actor(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster)  # the spec names no ray_address: serve joins this cluster
    config = deploy_yaml(tmp_path, "{backend: ray, num_cpus: 1}")
    with running_server(tmp_path / "serve.log", "--config", str(config), "--api-key", KEY) as url:
        r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"model": "smol", "messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0 and r.json()["choices"][0]["message"]["content"]

        [name] = replica_actors()
        actor = ray.get_actor(name, namespace="inferd")
        pid = ray.get(actor.pid.remote(), timeout=10)
        assert b"-m\0inferd.cli\0replica" in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert ray.available_resources().get("CPU") == 1.0  # the actor holds its num_cpus
    deadline = time.monotonic() + 15
    while (replica_actors() or running(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replica_actors() == [] and not running(pid), "stopping serve left the actor or its replica"
    assert ray.available_resources().get("CPU") == 2.0


def test_an_impossible_resource_request_fails_at_once(cluster):
    replica = make_replica(PlacementSpec(backend="ray", num_gpus=1), [])  # this process already joined the cluster
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no node of the Ray cluster has CPU 1, GPU 1 for one replica .*"
                                           "its nodes have: CPU 2, GPU 0"):
        replica.start()
    assert time.monotonic() - start < 5 and replica.actor is None and replica_actors() == []


def test_a_request_the_busy_cluster_cannot_place_fails_after_its_timeout(cluster):
    held = placement_group([{"CPU": 1}])  # another user holds one of the 2 CPUs
    ray.get(held.ready(), timeout=10)
    try:
        replica = RayReplica([], PlacementSpec(backend="ray", num_cpus=2), schedule_timeout_s=2)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Ray placed no replica in 2 s: it needs CPU 2; the cluster has CPU 1"):
            replica.start()
        assert time.monotonic() - start < 10 and replica.actor is None
    finally:
        remove_placement_group(held)
    deadline = time.monotonic() + 10
    while replica_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replica_actors() == []  # the unplaced actor was killed, not left pending
