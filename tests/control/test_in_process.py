"""Replicas in the gateway's process (placement.backend: in_process): the demo classical model served by its own
app on the gateway's transport, kept by a replica pool (adopted, scaled up, stopped), and the spec's rule of
which kinds run there."""
import asyncio
import time
from pathlib import Path

import httpx
import pytest

from inferd.classical.config import ClassicalConfig
from inferd.control.in_process import InProcessReplica
from inferd.control.kinds import gateway_model
from inferd.control.pool import READY, ReplicaPool
from inferd.control.spec import SpecError, load_spec
from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.deployments import Deployment, Upstream
from inferd.gateway.transport import UpstreamTransport
from tests.control.test_pool import until

ROW = {"inputs": [{"sepal_length_cm": 6.7, "sepal_width_cm": 3.0, "petal_length_cm": 5.2, "petal_width_cm": 2.3}]}


async def predict(transport: UpstreamTransport, replica: InProcessReplica, key: str | None) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport) as client:
        return await client.post(f"{replica.url}/v1/predict", json=ROW,
                                 headers={"authorization": f"Bearer {key}"} if key else {})


def test_a_classical_replica_in_the_gateways_process_under_a_pool():
    async def main():
        transport = UpstreamTransport()
        made: list[InProcessReplica] = []

        def make() -> InProcessReplica:
            made.append(InProcessReplica("classical", "default", "iris", ClassicalConfig(), transport))
            return made[-1]

        first = make()
        await asyncio.to_thread(first.start)  # as `inferd serve` starts it: before the gateway's loop serves
        first.wait_ready()
        card = first.card()  # read without a request: nothing answers before serve()
        assert (card["id"], card["kind"]) == ("iris", "classical") and card["digests"]["model"]
        deployment = Deployment("iris", gateway_model(card), [Upstream(first.url, first.api_key, name="iris-0")],
                                AdmissionQueue(QueueConfig(4)))
        pool = ReplicaPool(deployment, make, per_replica_inflight=4, target=1)
        pool.adopt(first, time.time(), time.time())
        await pool.start()  # runs the adopted replica's lifespan: warm once its readiness inference ran
        answer = await predict(transport, first, first.api_key)
        assert answer.status_code == 200 and answer.json()["predictions"] == ["virginica"]
        refused = await predict(transport, first, None)  # its own key still guards it
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]

        pool.scale_to(2)  # a second one, loaded in a thread and started on this loop
        await until(lambda: pool.counts()[READY] == 2, timeout_s=60)
        second = made[1]
        assert second.host != first.host and len(deployment.upstreams) == 2
        assert (await predict(transport, second, second.api_key)).json()["predictions"] == ["virginica"]

        await pool.close()
        assert not any(r.alive() for r in made)
        with pytest.raises(httpx.ConnectError):  # unmounted: its host is no host
            await predict(transport, first, first.api_key)
        await transport.aclose()
    asyncio.run(main())


SPEC = """
deployments:
  - name: iris
    kind: classical
    model: {source: default}
  - name: reacher
    kind: policy
    model: {source: default}
  - name: minilm
    kind: embedding
    model: {source: default}
"""


def test_only_the_cheap_kinds_run_in_the_gateways_process_and_only_when_asked(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    assert [d.placement.backend for d in load_spec(path).deployments] == ["local", "local", "local"]
    path.write_text(SPEC.replace("kind: classical\n", "kind: classical\n    placement: {backend: in_process}\n"))
    assert [d.placement.backend for d in load_spec(path).deployments] == ["in_process", "local", "local"]


@pytest.mark.parametrize("edit, message", [
    (("kind: embedding\n", "kind: embedding\n    placement: {backend: in_process}\n"),
     r"deployments\[2\].placement.backend: in_process runs classical and policy models only"),
    (("kind: policy\n", "kind: policy\n    placement: {backend: in_process, cpus: '0'}\n"),
     r"deployments\[1\].placement.cpus: only local replicas are pinned"),
])
def test_in_process_errors_name_the_field(tmp_path, edit, message):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.replace(*edit))
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_inferd_serve_with_the_classical_model_and_the_policy_in_its_process(tmp_path):
    """The contract through `inferd serve --config`: a key, a prediction, the policy over openpi's own client, a
    usage record per request, the models' own metrics in the gateway's /metrics, and no replica process."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from sqlalchemy import create_engine, text

    from inferd.policy.sim import ReacherTask
    from tests.server import db_url, server_process, wait_stored

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("kind: classical\n", "kind: classical\n    placement: {backend: in_process}\n")
                    .replace("kind: policy\n", "kind: policy\n    placement: {backend: in_process}\n")
                    .split("  - name: minilm")[0])
    key = "sk-in-process-e2e"
    log = tmp_path / "serve.log"
    with server_process(log, "--config", str(spec), "--api-key", key) as (proc, url):
        auth = {"authorization": f"Bearer {key}"}
        answer = httpx.post(f"{url}/v1/predict", json={"model": "iris"} | ROW, headers=auth, timeout=30)
        assert answer.status_code == 200 and answer.json()["predictions"] == ["virginica"]
        bad = httpx.post(f"{url}/v1/predict", json={"model": "iris", "inputs": [{"x": 1}]}, headers=auth, timeout=30)
        assert bad.status_code == 400 and "unknown feature 'x'" in bad.json()["error"]["message"]
        policy = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/policies/reacher/ws", api_key=key)
        chunk = policy.infer(ReacherTask(0).observation())
        assert chunk["actions"].shape == (10, 2) and chunk["late"] is False
        policy._ws.close()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "inferd_classical_requests_total" in metrics and "inferd_policy_batch_observations_count" in metrics
        heads = [" ".join(line.split()[:3]) for line in metrics.splitlines() if line.startswith(("# HELP", "# TYPE"))]
        assert len(heads) == len(set(heads))  # a family once, as strict parsers (promtool) want; two pools here
        children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
        assert children == []  # both models answer from the gateway's own process
        wait_stored(url)
    with create_engine(db_url(log)).connect() as db:
        rows = db.execute(text("SELECT model, status, http_status FROM usage_records ORDER BY started_unix_s")).all()
    assert [tuple(r) for r in rows][:2] == [("iris", "completed", 200), ("iris", "rejected", 400)]
    assert ("reacher", "completed", 101) in [tuple(r) for r in rows]


def _parent(proc_dir) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
