"""Gradient-boosted trees on their own libraries: XGBoost's Booster (.json, .ubj) and LightGBM's (.txt).

Both route a missing value down each split's default branch, so their features take null by default. A
classifier's answer is what its scikit-learn wrapper answers for the same rows: XGBoost binary
(binary:logistic) p -> [1 - p, p] and class p > 0.5, multi:softprob -> argmax; LightGBM binary p ->
[1 - p, p], every classifier's class the argmax of its probabilities. Objectives that give labels only
(binary:hinge, multi:softmax) answer predictions without probabilities; the rest are regressors.
"""
import json
from pathlib import Path

import numpy as np

from inferd.classical.config import ClassicalConfig
from inferd.models.errors import ModelLoadError
from inferd.protocol.classical import Feature, TabularSchema, default_features

XGB_TYPES = {"int": "int64", "i": "int64"}  # anything else (float, q) is float


class XGBoostPredictor:
    format = "xgboost"

    def __init__(self, path: Path, config: ClassicalConfig, sha256: str):
        import xgboost as xgb
        try:
            self.booster = xgb.Booster(model_file=str(path))
        except xgb.core.XGBoostError as exc:
            raise ModelLoadError(f"{path}: XGBoost cannot load it: {str(exc).splitlines()[0]}") from None
        self.booster.set_param({"nthread": config.num_threads})
        self.library = f"xgboost {xgb.__version__}"
        learner = json.loads(self.booster.save_config())["learner"]
        self.objective = learner["objective"]["name"]
        num_class = int(learner["learner_model_param"].get("num_class", "0"))
        names, types = self.booster.feature_names, self.booster.feature_types or []
        self.named = names is not None
        if self.named:
            features = tuple(Feature(n, XGB_TYPES.get(t, "float64") if t else "float64", True)
                             for n, t in zip(names, types or [None] * len(names)))
        else:
            features = default_features(self.booster.num_features(), "f", allow_nan=True)
        classifier = self.objective.startswith(("binary:", "multi:"))
        classes = tuple(range(max(num_class, 2))) if classifier else None
        self.schema = TabularSchema(features, "classifier" if classifier else "regressor", classes)

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        out = self.booster.inplace_predict(rows, predict_type="value", missing=np.nan, validate_features=False)
        if self.objective == "binary:logistic":
            probabilities = np.vstack((1 - out, out)).T
            labels = np.zeros(len(out), dtype=np.int64)
            labels[out > 0.5] = 1
            return labels, probabilities
        if self.objective == "multi:softprob":
            return np.argmax(out, axis=1), out
        if self.schema.task == "classifier":
            return out.astype(np.int64), None
        return out, None


class LightGBMPredictor:
    format = "lightgbm"

    def __init__(self, path: Path, config: ClassicalConfig, sha256: str):
        import lightgbm as lgb
        try:
            self.booster = lgb.Booster(model_file=str(path))
        except lgb.basic.LightGBMError as exc:
            raise ModelLoadError(f"{path}: LightGBM cannot load it: {exc}") from None
        self.threads = config.num_threads
        self.library = f"lightgbm {lgb.__version__}"
        dump = self.booster.dump_model(num_iteration=0)
        self.objective = str(dump.get("objective", "regression")).split()[0]
        names = self.booster.feature_name()
        self.named = not all(n == f"Column_{i}" for i, n in enumerate(names))
        features = tuple(Feature(n, "float64", True) for n in names)
        classifier = self.objective in ("binary", "multiclass", "multiclassova")
        classes = tuple(range(max(int(dump.get("num_class", 1)), 2))) if classifier else None
        self.schema = TabularSchema(features, "classifier" if classifier else "regressor", classes)

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        out = self.booster.predict(rows, num_threads=self.threads)
        if self.schema.task == "regressor":
            return out, None
        probabilities = np.vstack((1.0 - out, out)).T if out.ndim == 1 else out
        return np.argmax(probabilities, axis=1), probabilities
