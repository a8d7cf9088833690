"""The classical kind in the control plane: the deployment spec's `kind: classical` with its settings, the
replica's arguments (a list setting travels as JSON), the gateway's model part from a card or the files."""
import pytest

from inferd.classical.config import ClassicalConfig
from inferd.cli import _parser
from inferd.control.kinds import gateway_model, model_from_files
from inferd.control.launch import classical_spec, replica_args
from inferd.control.spec import SpecError, load_spec
from inferd.gateway.deployments import ClassicalModel
from inferd.models.unpack import file_sha256
from inferd.settings import config_from
from tests.classical import models


def spec(tmp_path, runtime: str, source: str, sha: str = "") -> str:
    pin = f', sha256: "{sha}"' if sha else ""
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""
deployments:
  - name: cancer
    kind: classical
    model: {{source: "{source}"{pin}}}
    runtime: {runtime}
    replicas: 2
""")
    return path


def test_a_classical_deployment_with_its_settings_and_pinned_digest(tmp_path):
    source = str(models.forest_skops().path)
    runtime = ("{max_batch_rows: 128, num_threads: 1, trusted_types: [sklearn.tree._tree.Tree], "
               "features: [{name: a, dtype: float32}]}")
    [d] = load_spec(spec(tmp_path, runtime, source, file_sha256(models.forest_skops().path))).deployments
    assert isinstance(d.runtime, ClassicalConfig) and d.runtime.max_batch_rows == 128
    assert d.runtime.features == [{"name": "a", "dtype": "float32"}] and d.runtime.replica_slots == 64
    with pytest.raises(SpecError, match=r"deployments\[0\].model.sha256"):
        load_spec(spec(tmp_path, "{}", source, "0" * 64))
    with pytest.raises(SpecError, match=r"deployments\[0\].runtime.max_batch_rows: must be at least 1"):
        load_spec(spec(tmp_path, "{max_batch_rows: 0}", source))
    with pytest.raises(SpecError, match=r"runtime.max_num_seqs: unknown field"):
        load_spec(spec(tmp_path, "{max_num_seqs: 4}", source))


def test_a_pickle_is_refused_in_the_spec_unless_allowed_and_pinned(tmp_path):
    path = tmp_path / "m.pkl"
    path.write_bytes(b"anything")
    with pytest.raises(SpecError, match=r"runtime.allow_pickle: m.pkl is a pickle"):
        load_spec(spec(tmp_path, "{allow_pickle: true}", str(path)))
    load_spec(spec(tmp_path, f'{{allow_pickle: true, pickle_sha256: "{file_sha256(path)}"}}', str(path)))
    (tmp_path / "m.h5").write_bytes(b"x")
    with pytest.raises(SpecError, match="unknown format '.h5'"):
        load_spec(spec(tmp_path, "{}", str(tmp_path / "m.h5")))


def test_replica_arguments_give_the_settings_back():
    config = ClassicalConfig(max_batch_rows=32, features=[{"name": "x", "dtype": "int64", "allow_nan": True}],
                             allow_pickle=True, pickle_sha256="a" * 64)
    args = replica_args("m.skops", "cancer", config, kind="classical")
    assert args[:4] == ["--kind", "classical", "m.skops", "--served-model-name"]
    parsed = _parser("classical").parse_args(["replica", *args])
    assert (parsed.kind, parsed.model) == ("classical", "m.skops") and config_from(ClassicalConfig, parsed) == config
    assert classical_spec().name == "iris-classifier" and classical_spec("/m/churn.onnx").name == "churn"


def test_the_gateways_model_part_from_a_card_or_the_files():
    files_part = model_from_files("classical", str(models.xgboost_cancer().path), ClassicalConfig())
    assert isinstance(files_part, ClassicalModel) and files_part.platform == "xgboost"
    card = {"kind": "classical", "format": "xgboost", "platform": "xgboost", "schema": files_part.schema.as_dict()}
    assert gateway_model(card) == files_part
    assert files_part.card()["schema"]["features"][0]["name"] == "mean_radius"
