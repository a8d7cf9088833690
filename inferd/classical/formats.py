"""Loading a classical model: the file's suffix says its format and so how it runs, its sha256 is its pin.

    .onnx          onnxruntime (CPU), its input schema read from the file       onnx_format.py
    .json .ubj     XGBoost's own Booster (a model saved with save_model)        tree_formats.py
    .txt .lgb      LightGBM's own Booster (a model saved with save_model)       tree_formats.py
    .skops         a scikit-learn estimator or pipeline; trusted types only     sklearn_format.py
    .pkl .joblib   pickle: refused unless allow_pickle and its pinned sha256    sklearn_format.py

The schema: features the file names (ONNX inputs, XGBoost/LightGBM feature names, scikit-learn's
feature_names_in_) unless the settings give `features`, or MODEL.schema.json beside the model does
({"features": [{"name", "dtype", "allow_nan"}]}); a file that names none gets its library's own names
(x0, x1, ... / f0, f1, ...). The formats are imported when used: a replica loads only its own library.
"""
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from inferd.classical.config import ClassicalConfig
from inferd.classical.schema_file import read_schema_file, schema_path
from inferd.models.errors import ModelLoadError
from inferd.models.unpack import file_sha256
from inferd.protocol.classical import TabularSchema

log = logging.getLogger(__name__)

FORMATS = {".onnx": "onnx", ".json": "xgboost", ".ubj": "xgboost", ".txt": "lightgbm", ".lgb": "lightgbm",
           ".skops": "skops", ".pkl": "pickle", ".pickle": "pickle", ".joblib": "pickle"}
PLATFORMS = {"onnx": "onnxruntime_onnx", "xgboost": "xgboost", "lightgbm": "lightgbm", "skops": "sklearn",
             "pickle": "sklearn"}


class Predictor(Protocol):
    """One loaded model: rows in, predictions (and a classifier's probabilities) out, in the worker thread."""
    format: str
    library: str  # "xgboost 3.2.0"
    schema: TabularSchema  # as the file says it (names maybe the library's defaults)
    named: bool  # the file itself names its features

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]: ...


@dataclass(slots=True)
class ClassicalModelFiles:
    """A model as loaded: what runs it, the schema requests are checked against, and the files' digests."""
    name: str
    path: Path
    predictor: Predictor
    schema: TabularSchema
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return self.predictor.format

    @property
    def platform(self) -> str:
        return PLATFORMS[self.predictor.format]


def load_classical_model(source: str | Path | None = None, config: ClassicalConfig | None = None
                         ) -> ClassicalModelFiles:
    """Load a model file (None: the demo iris classifier, trained on first use)."""
    from inferd.classical.demo import DEMO_NAME, demo_model_path
    config = config or ClassicalConfig()
    path = demo_model_path() if source is None else Path(source).expanduser()
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ModelLoadError(f"{path}: unknown model format {path.suffix!r}; inferd runs "
                             f"{', '.join(sorted(FORMATS))} files")
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file")
    digests = {"model": file_sha256(path)}
    predictor = loader(kind)(path, config, digests["model"])
    schema, schema_digest = resolved_schema(path, predictor, config)
    if schema_digest:
        digests["schema"] = schema_digest
    log.info("loaded %s model %s (%s, %d features, %s); sha256 %s", kind, path, predictor.library,
             len(schema.features), schema.task, digests["model"])
    return ClassicalModelFiles(DEMO_NAME if source is None else path.stem, path, predictor, schema, digests)


def loader(kind: str) -> Callable[[Path, ClassicalConfig, str], Predictor]:
    if kind == "onnx":
        from inferd.classical.onnx_format import OnnxPredictor
        return OnnxPredictor
    if kind in ("xgboost", "lightgbm"):
        from inferd.classical.tree_formats import LightGBMPredictor, XGBoostPredictor
        return XGBoostPredictor if kind == "xgboost" else LightGBMPredictor
    from inferd.classical.sklearn_format import load_pickle, load_skops
    return load_skops if kind == "skops" else load_pickle


def resolved_schema(path: Path, predictor: Predictor, config: ClassicalConfig) -> tuple[TabularSchema, str | None]:
    """The schema requests are checked against, and the schema file's digest when one was read."""
    given, digest = config.schema_features, None
    if given is None and schema_path(path).is_file():
        given, digest = read_schema_file(schema_path(path)), file_sha256(schema_path(path))
    own = predictor.schema
    if given is None:
        if not predictor.named:
            log.warning("%s names no features; requests use %s (give features to name them)", path,
                        ", ".join(own.names[:3]) + (", ..." if len(own.features) > 3 else ""))
        return own, None
    if len(given) != len(own.features):
        raise ModelLoadError(f"{path} reads {len(own.features)} features; the schema gives {len(given)}")
    if predictor.named and [f.name for f in given] != own.names:
        raise ModelLoadError(f"{path} names its features {', '.join(own.names)}; the schema's differ")
    return replace(own, features=given), digest
