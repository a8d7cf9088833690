"""ONNX models on onnxruntime's CPU provider, its threads set explicitly; the input schema is the file's.

Inputs: one [rows, features] tensor (what skl2onnx writes: its features are named by the model's metadata
`feature_names`, a JSON list, else by the schema, else `input_name`_0, _1, ...), or one [rows, 1] tensor
per feature (names and dtypes from the file). Outputs: a
regressor has one; a classifier a label and probabilities (a tensor, or skl2onnx's ZipMap of class ->
probability). Classes come from the graph's classlabels_* attribute, else from the model's metadata
(`classes`, JSON), else 0..C-1.
"""
import json
from importlib.metadata import version
from pathlib import Path

import numpy as np

from inferd.classical.config import ClassicalConfig
from inferd.models.errors import ModelLoadError
from inferd.protocol.classical import Feature, TabularSchema, default_features

ONNX_DTYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(int64)": "int64",
               "tensor(int32)": "int32", "tensor(bool)": "bool"}
NUMPY = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32, "bool": np.bool_}


class OnnxPredictor:
    format = "onnx"

    def __init__(self, path: Path, config: ClassicalConfig, sha256: str):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = config.num_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types for files it cannot read
            raise ModelLoadError(f"{path}: onnxruntime cannot load it: {exc}") from None
        self.library = f"onnxruntime {version('onnxruntime')}"
        self.inputs = self.session.get_inputs()
        outputs = self.session.get_outputs()
        features, self.named, input_name = self._features(path)
        classifier = len(outputs) >= 2
        self.output_names = [o.name for o in outputs[:2]]
        classes = _classes(path, self.session) if classifier else None
        if classifier and classes is None:
            width = outputs[1].shape[-1] if outputs[1].shape and isinstance(outputs[1].shape[-1], int) else None
            classes = tuple(range(width)) if width else None
        self.schema = TabularSchema(features, "classifier" if classifier else "regressor", classes, input_name)

    def _features(self, path: Path) -> tuple[tuple[Feature, ...], bool, str]:
        first = self.inputs[0]
        self.matrix_input = len(self.inputs) == 1 and len(first.shape) == 2 and first.shape[1] != 1
        if self.matrix_input:
            if not isinstance(first.shape[1], int):
                raise ModelLoadError(f"{path}: its input {first.name} has no fixed number of features")
            self.dtypes, dtype = [NUMPY[_dtype(path, first)]], _dtype(path, first)
            names = json.loads(self.session.get_modelmeta().custom_metadata_map.get("feature_names", "null"))
            if isinstance(names, list) and len(names) == first.shape[1]:
                return tuple(Feature(str(n), dtype) for n in names), True, first.name
            return default_features(first.shape[1], f"{first.name}_", dtype), False, first.name
        for i in self.inputs:
            if len(i.shape) != 2 or i.shape[1] != 1:
                raise ModelLoadError(f"{path}: input {i.name} has shape {i.shape}; inferd reads one "
                                     "[rows, features] input, or one [rows, 1] input per feature")
        self.dtypes = [NUMPY[_dtype(path, i)] for i in self.inputs]
        return tuple(Feature(i.name, _dtype(path, i)) for i in self.inputs), True, "input"

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        out = self.session.run(self.output_names, self._feeds(rows))
        if self.schema.task == "regressor":
            return out[0].reshape(len(rows), -1)[:, 0] if out[0].ndim > 1 else out[0], None
        probabilities = out[1]
        if isinstance(probabilities, list):  # ZipMap: one {class: probability} per row
            probabilities = np.array([[row[c] for c in self.schema.classes] for row in probabilities],
                                     dtype=np.float32)
        return out[0], probabilities

    def _feeds(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        if self.matrix_input:
            return {self.inputs[0].name: rows.astype(self.dtypes[0])}
        return {i.name: rows[:, j:j + 1].astype(t) for j, (i, t) in enumerate(zip(self.inputs, self.dtypes))}


def _dtype(path: Path, node) -> str:
    if node.type not in ONNX_DTYPES:
        raise ModelLoadError(f"{path}: input {node.name} is {node.type}; inferd feeds "
                             f"{', '.join(ONNX_DTYPES)}")
    return ONNX_DTYPES[node.type]


def _classes(path: Path, session) -> tuple | None:
    meta = session.get_modelmeta().custom_metadata_map
    if "classes" in meta:
        return tuple(json.loads(meta["classes"]))
    import onnx
    from onnx.helper import get_attribute_value
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        for attr in node.attribute:
            if attr.name.startswith("classlabels_"):
                labels = get_attribute_value(attr)
                if len(labels):
                    return tuple(v.decode() if isinstance(v, bytes) else int(v) for v in labels)
    return None
