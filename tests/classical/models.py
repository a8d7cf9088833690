"""Model files the classical tests serve, trained here on scikit-learn's own data sets (seconds), each with
the library object that made it: what the server answers is checked against that object's own predict."""
import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris
from sklearn.preprocessing import StandardScaler

CANCER_FEATURES = [n.replace(" ", "_") for n in load_breast_cancer().feature_names]
IRIS_FEATURES = ["sepal_length_cm", "sepal_width_cm", "petal_length_cm", "petal_width_cm"]


class CustomScaler(StandardScaler):
    """A type skops does not know: loading a file that holds it needs trusted_types."""


@dataclass(slots=True)
class Trained:
    path: Path
    reference: object  # the library's object: predict / predict_proba (or onnxruntime's session)
    features: list[str]
    X: np.ndarray  # rows to ask about


def root() -> Path:
    return Path(tempfile.mkdtemp(prefix="inferd-classical-"))


@functools.cache
def cancer() -> tuple[np.ndarray, np.ndarray]:
    return load_breast_cancer(return_X_y=True)


def write_schema(path: Path, features: list[str], allow_nan: bool = False) -> None:
    schema = {"features": [{"name": n, "dtype": "float64", "allow_nan": allow_nan} for n in features]}
    path.with_name(path.name.rsplit(".", 1)[0] + ".schema.json").write_text(json.dumps(schema))


@functools.cache
def logistic_skops() -> Trained:
    import skops.io as sio
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    X, y = cancer()
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(X, y)
    path = root() / "cancer-logreg.skops"
    sio.dump(model, path)
    write_schema(path, CANCER_FEATURES)
    return Trained(path, model, CANCER_FEATURES, X)


@functools.cache
def forest_skops() -> Trained:
    import skops.io as sio
    from sklearn.ensemble import RandomForestClassifier
    X, y = cancer()
    model = RandomForestClassifier(n_estimators=30, max_depth=6, random_state=0).fit(X, y)
    path = root() / "cancer-forest.skops"
    sio.dump(model, path)
    write_schema(path, CANCER_FEATURES)
    return Trained(path, model, CANCER_FEATURES, X)


@functools.cache
def xgboost_iris() -> Trained:
    import xgboost as xgb
    X, y = load_iris(return_X_y=True)
    model = xgb.XGBClassifier(n_estimators=20, max_depth=3, random_state=0).fit(X, y)
    path = root() / "iris-xgb.json"
    model.save_model(path)
    write_schema(path, IRIS_FEATURES, allow_nan=True)
    return Trained(path, model, IRIS_FEATURES, X)


@functools.cache
def xgboost_cancer() -> Trained:
    """Binary, its feature names in the file (no schema file)."""
    import xgboost as xgb
    X, y = cancer()
    model = xgb.XGBClassifier(n_estimators=30, max_depth=4, random_state=0)
    model.fit(X, y)
    model.get_booster().feature_names = CANCER_FEATURES
    path = root() / "cancer-xgb.ubj"
    model.save_model(path)
    return Trained(path, model, CANCER_FEATURES, X)


@functools.cache
def lightgbm_regressor() -> Trained:
    import lightgbm as lgb
    X, y = load_diabetes(return_X_y=True)
    names = [f"d{i}" for i in range(X.shape[1])]
    model = lgb.LGBMRegressor(n_estimators=20, verbose=-1, random_state=0).fit(X, y, feature_name=names)
    path = root() / "diabetes-lgbm.txt"
    model.booster_.save_model(str(path))
    return Trained(path, model, names, X)


@functools.cache
def onnx_logistic() -> Trained:
    """skl2onnx's conversion of the logistic pipeline: one float [rows, 30] input named X, its features
    named by the model's metadata; the reference is onnxruntime on the same file."""
    import onnxruntime as ort
    from skl2onnx import to_onnx
    X, _ = cancer()
    onnx_model = to_onnx(logistic_skops().reference, X[:1].astype(np.float32), options={"zipmap": False})
    entry = onnx_model.metadata_props.add()
    entry.key, entry.value = "feature_names", json.dumps(CANCER_FEATURES)
    path = root() / "cancer-logreg.onnx"
    path.write_bytes(onnx_model.SerializeToString())
    return Trained(path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), CANCER_FEATURES, X)


def custom_skops() -> Path:
    import skops.io as sio
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    X, y = cancer()
    path = root() / "custom.skops"
    sio.dump(make_pipeline(CustomScaler(), LogisticRegression(max_iter=1000)).fit(X, y), path)
    return path


def rows(trained: Trained, indices) -> list[dict]:
    return [dict(zip(trained.features, map(float, trained.X[i]))) for i in indices]


def expected(trained: Trained, indices) -> tuple[list, list | None]:
    """What the library itself answers for these rows (a regressor: no probabilities)."""
    X = trained.X[list(indices)]
    ref = trained.reference
    if hasattr(ref, "run"):  # an onnxruntime session
        label, proba = ref.run(None, {ref.get_inputs()[0].name: X.astype(np.float32)})
        return label.tolist(), proba.tolist()
    if hasattr(ref, "predict_proba"):
        return ref.predict(X).tolist(), ref.predict_proba(X).tolist()
    return ref.predict(X).tolist(), None
