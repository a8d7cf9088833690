"""Found by the hostile-input fuzzer (tests/gateway/test_hostile.py): a body of 100,000 nested lists or objects
was a 500 (json.loads' RecursionError) on every JSON route but the v2 ones (orjson); now a 400 invalid_json."""
import pytest
from starlette.testclient import TestClient

from inferd.gateway.app import build_gateway_app
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, ok
from tests.hostile import deeply_nested


@pytest.mark.parametrize("kind", ["list", "object"])
def test_a_body_nested_100k_deep_is_invalid_json_on_every_route_that_reads_json(tmp_path, kind):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")], admin_key="adm",
                           files_dir=tmp_path / "files")
    with TestClient(build_gateway_app(gw)) as client:
        for path, k in [("/v1/chat/completions", key), ("/v1/completions", key), ("/tokenize", key),
                        ("/detokenize", key), ("/v1/batches", key), ("/admin/tenants", "adm")]:
            r = client.post(path, content=deeply_nested(100_000, kind), headers={"authorization": f"Bearer {k}"})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json"), path
