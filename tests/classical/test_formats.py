"""Each format loads with its schema and answers what its library answers; pickles and untrusted skops types
are refused unless the settings say otherwise."""
import json
import pickle

import numpy as np
import pytest

from inferd.classical.config import ClassicalConfig
from inferd.classical.formats import load_classical_model
from inferd.models.errors import ModelLoadError
from inferd.settings import SettingError
from tests.classical import models

FORMATS = [("skops", models.logistic_skops, "classifier"), ("skops", models.forest_skops, "classifier"),
           ("xgboost", models.xgboost_iris, "classifier"), ("xgboost", models.xgboost_cancer, "classifier"),
           ("lightgbm", models.lightgbm_regressor, "regressor"), ("onnx", models.onnx_logistic, "classifier")]


@pytest.mark.parametrize("fmt, make, task", FORMATS, ids=lambda v: getattr(v, "__name__", v))
def test_each_format_answers_as_its_library(fmt, make, task):
    trained = make()
    files = load_classical_model(trained.path)
    assert (files.format, files.schema.task, files.schema.names) == (fmt, task, trained.features)
    assert files.digests["model"] and len(files.digests["model"]) == 64
    predictions, probabilities = files.predictor.predict(trained.X)
    want, want_proba = models.expected(trained, range(len(trained.X)))
    assert predictions.tolist() == want  # trees and labels: exactly
    if want_proba is None:
        assert probabilities is None
    else:
        assert np.abs(np.asarray(probabilities) - np.asarray(want_proba)).max() <= 1e-6


def test_the_schema_comes_from_the_file_the_settings_or_the_file_beside_it():
    onnx = load_classical_model(models.onnx_logistic().path)
    assert onnx.schema.input_name == "X" and {f.dtype for f in onnx.schema.features} == {"float32"}
    assert "schema" not in onnx.digests  # the ONNX file names its features itself
    forest = load_classical_model(models.forest_skops().path)
    assert forest.schema.names == models.CANCER_FEATURES and forest.digests["schema"]
    assert forest.schema.classes == (0, 1)
    xgb = load_classical_model(models.xgboost_iris().path)
    assert all(f.allow_nan for f in xgb.schema.features)  # trees route missing values
    named = [{"name": f"v{i}", "dtype": "float32"} for i in range(30)]
    renamed = load_classical_model(models.forest_skops().path, ClassicalConfig(features=named))
    assert renamed.schema.names[:2] == ["v0", "v1"] and "schema" not in renamed.digests
    with pytest.raises(ModelLoadError, match="reads 30 features; the schema gives 2"):
        load_classical_model(models.forest_skops().path, ClassicalConfig(features=named[:2]))
    with pytest.raises(ModelLoadError, match="names its features"):
        load_classical_model(models.onnx_logistic().path, ClassicalConfig(features=named))


def test_a_pickle_needs_allow_pickle_and_its_pinned_sha256(tmp_path):
    from inferd.models.unpack import file_sha256
    path = tmp_path / "forest.pkl"
    path.write_bytes(pickle.dumps(models.forest_skops().reference))
    with pytest.raises(ModelLoadError, match="runs arbitrary code"):
        load_classical_model(path)
    with pytest.raises(ModelLoadError, match="needs pickle_sha256"):
        load_classical_model(path, ClassicalConfig(allow_pickle=True))
    with pytest.raises(ModelLoadError, match="not the pinned"):
        load_classical_model(path, ClassicalConfig(allow_pickle=True, pickle_sha256="0" * 64))
    loaded = load_classical_model(path, ClassicalConfig(allow_pickle=True, pickle_sha256=file_sha256(path)))
    assert loaded.format == "pickle" and loaded.platform == "sklearn"


def test_an_untrusted_skops_type_refuses_the_load_naming_it():
    path = models.custom_skops()
    with pytest.raises(ModelLoadError, match=r"holds the type tests\.classical\.models\.CustomScaler"):
        load_classical_model(path)
    trusted = ClassicalConfig(trusted_types=["tests.classical.models.CustomScaler"])
    assert load_classical_model(path, trusted).schema.task == "classifier"


def test_unknown_formats_and_bad_settings_are_refused(tmp_path):
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unknown model format"):
        load_classical_model(tmp_path / "m.bin")
    (tmp_path / "m.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load it"):
        load_classical_model(tmp_path / "m.onnx")
    for bad in ({"features": [{"name": "a", "dtype": "complex"}]}, {"features": [{"name": "a"}, {"name": "a"}]},
                {"pickle_sha256": "abc"}, {"max_batch_rows": 0}):
        with pytest.raises(SettingError):
            ClassicalConfig(**bad)


def test_the_demo_model_trains_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    from inferd.classical.demo import DEMO_NAME, demo_model_path
    files = load_classical_model(None)
    assert files.name == DEMO_NAME and files.path == demo_model_path() and files.path.parent == tmp_path / "classical"
    assert files.schema.classes == ("setosa", "versicolor", "virginica")
    assert json.loads(files.path.with_name(files.path.name.replace(".skops", ".schema.json")).read_text())
    before = files.path.stat().st_mtime_ns
    assert load_classical_model(None).path.stat().st_mtime_ns == before
    predictions, _ = files.predictor.predict(np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]))
    assert predictions.tolist() == ["setosa", "virginica"]
