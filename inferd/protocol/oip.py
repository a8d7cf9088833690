"""The Open Inference Protocol (KServe v2) as the classical kind speaks it, on gateway and replica alike: the
infer request's typed tensors, checked against a model's schema into the same matrix as /v1/predict, and
the error shape v2 clients read, `{"error": "message"}` (tritonclient raises it as its message).

Inputs: one tensor named after the schema's input_name, shape [rows, features], columns in the schema's
order; or one tensor per feature, named after it, shape [rows] or [rows, 1]. `data` is row-major, flat or
nested. JSON tensors only: the binary tensor extension is refused.
"""
import math
import re
from dataclasses import replace

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from inferd.protocol.classical import (MAX_PREDICT_BODY_BYTES, TabularSchema, check_names, check_num_rows,
                                       matrix)
from inferd.protocol.errors import InvalidRequest, to_api_error

INT_TYPES = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
FLOAT_TYPES = ("FP16", "FP32", "FP64")
DATATYPES = ("BOOL", *INT_TYPES, *FLOAT_TYPES)
FEATURE_DATATYPES = {"bool": ("BOOL",), "int32": INT_TYPES, "int64": INT_TYPES,
                     "float32": FLOAT_TYPES + INT_TYPES, "float64": FLOAT_TYPES + INT_TYPES}
MAX_BODY_BYTES = MAX_PREDICT_BODY_BYTES
# the protocol's paths (server metadata, health, a model's metadata, readiness and inference): an error on one is
# answered in the protocol's shape; any other path, under /v2/ or not, is no route of it (protocol/http.py)
PATHS = re.compile(r"/v2(/health/(live|ready)|/models/[^/]+(/versions/[^/]+)?(/ready|/infer)?)?")


class TensorInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    shape: list[int]
    datatype: str
    data: list
    parameters: dict | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    parameters: dict | None = None


class InferRequest(BaseModel):
    """POST /v2/models/{name}[/versions/{version}]/infer; the model comes from the path."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    parameters: dict | None = None
    inputs: list[TensorInput] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None

    @property
    def num_rows(self) -> int:
        return self.inputs[0].shape[0] if self.inputs[0].shape else 0


def infer_matrix(schema: TabularSchema, body: InferRequest) -> np.ndarray:
    """The [rows, features] float64 matrix the tensors hold, every value checked as /v1/predict checks it."""
    tensors = {t.name: (t, _flat(t)) for t in body.inputs}
    if len(tensors) != len(body.inputs):
        raise InvalidRequest("Two input tensors have the same name.", param="inputs")
    if set(tensors) == {schema.input_name}:
        t, flat = tensors[schema.input_name]
        width = len(schema.features)
        if len(t.shape) != 2 or t.shape[1] != width:
            raise InvalidRequest(f"The tensor '{t.name}' has shape {t.shape}; this model reads [rows, {width}] "
                                 f"({', '.join(schema.names)}).", param=f"inputs.{t.name}.shape")
        check_num_rows(t.shape[0], "inputs")
        return _one_matrix(schema, t, flat)
    check_names(schema, tensors, "inputs")
    rows = {t.shape[0] if t.shape else -1 for t, _ in tensors.values()}
    for t, _ in tensors.values():
        if len(t.shape) not in (1, 2) or len(t.shape) == 2 and t.shape[1] != 1 or len(rows) > 1:
            raise InvalidRequest(f"The tensor '{t.name}' has shape {t.shape}; a feature's tensor is [rows] or "
                                 "[rows, 1], the same rows for every feature.", param=f"inputs.{t.name}.shape")
    check_num_rows(rows.pop(), "inputs")
    for f in schema.features:
        _check_datatype(tensors[f.name][0], f.dtype, f.name)
    return matrix(schema, {name: flat for name, (_, flat) in tensors.items()},
                  lambda name: lambda i: f"inputs.{name}.data[{i}]")


def _one_matrix(schema: TabularSchema, t: TensorInput, flat: list) -> np.ndarray:
    """A [rows, features] tensor has one datatype for every feature: its values are checked as that type
    says, then an int feature's must be whole numbers and a bool feature's 0 or 1."""
    width, where = len(schema.features), lambda name: lambda i: f"inputs.{t.name}.data[{i}].{name}"
    sent = "bool" if t.datatype == "BOOL" else "int64" if t.datatype in INT_TYPES else "float64"
    as_sent = replace(schema, features=tuple(replace(f, dtype=f.dtype if f.dtype == "int32" and sent == "int64"
                                                     else sent) for f in schema.features))
    out = matrix(as_sent, {f.name: flat[j::width] for j, f in enumerate(schema.features)}, where)
    for j, f in enumerate(schema.features):
        column = out[:, j]
        bad = (column != np.round(column)) if f.dtype in ("int32", "int64") else \
            (column != 0) & (column != 1) if f.dtype == "bool" else None
        if bad is not None and (bad & ~np.isnan(column)).any():
            i = int(np.flatnonzero(bad & ~np.isnan(column))[0])
            takes = "0 or 1 (false, true)" if f.dtype == "bool" else "whole numbers"
            raise InvalidRequest(f"{where(f.name)(i)} is {column[i]:g}; {f.name} is {f.dtype} and takes {takes}.",
                                 param=where(f.name)(i))
    return out


def _flat(t: TensorInput) -> list:
    if t.parameters and "binary_data_size" in t.parameters:
        raise InvalidRequest("Binary tensor data is not supported; send the tensor's data as JSON "
                             "(tritonclient: binary_data=False).", param=f"inputs.{t.name}")
    if t.datatype not in DATATYPES:
        raise InvalidRequest(f"The tensor '{t.name}' has datatype {t.datatype!r}; a classical model takes "
                             f"{', '.join(DATATYPES)}.", param=f"inputs.{t.name}.datatype")
    flat = t.data
    while flat and isinstance(flat[0], list):
        flat = [v for row in flat for v in (row if isinstance(row, list) else [row])]
    if any(d < 0 for d in t.shape) or math.prod(t.shape) != len(flat):
        raise InvalidRequest(f"The tensor '{t.name}' has shape {t.shape} but holds {len(flat)} values.",
                             param=f"inputs.{t.name}.shape")
    if t.datatype in INT_TYPES and not all(type(v) is int for v in flat):
        raise InvalidRequest(f"The tensor '{t.name}' is {t.datatype} but holds a value that is not an integer.",
                             param=f"inputs.{t.name}.data")
    return flat


def _check_datatype(t: TensorInput, dtype: str, feature: str) -> None:
    if t.datatype not in FEATURE_DATATYPES[dtype]:
        raise InvalidRequest(f"The tensor '{t.name}' is {t.datatype}; the feature '{feature}' is {dtype} and takes "
                             f"{', '.join(FEATURE_DATATYPES[dtype])}.", param=f"inputs.{t.name}.datatype")


def oip_error_response(exc: BaseException, map_error=to_api_error) -> JSONResponse:
    """The v2 error shape, with the status and headers (Retry-After) the error tree gives it."""
    err = map_error(exc)
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers or None)


# what both sides answer

PREDICT, PROBABILITIES = "predict", "predict_proba"  # output names, as MLServer's scikit-learn runtime has them


def model_metadata(name: str, versions: list[str], platform: str, schema: TabularSchema) -> dict:
    """GET /v2/models/{name}: the [rows, features] input and the outputs, with the schema as parameters."""
    dtypes = {f.dtype for f in schema.features}
    input_type = "FP32" if dtypes == {"float32"} else "INT64" if dtypes <= {"int32", "int64"} else "FP64"
    outputs = [{"name": PREDICT, "datatype": prediction_datatype(schema), "shape": [-1]}]
    if schema.task == "classifier":
        width = len(schema.classes) if schema.classes else -1
        outputs.append({"name": PROBABILITIES, "datatype": "FP64", "shape": [-1, width]})
    return {"name": name, "versions": versions, "platform": platform,
            "inputs": [{"name": schema.input_name, "datatype": input_type, "shape": [-1, len(schema.features)]}],
            "outputs": outputs, "parameters": {"task": schema.task, "features": [f.as_dict() for f in schema.features],
                                               "classes": None if schema.classes is None else list(schema.classes)}}


def prediction_datatype(schema: TabularSchema) -> str:
    if schema.task == "regressor":
        return "FP64"
    return "BYTES" if schema.classes and isinstance(schema.classes[0], str) else "INT64"


def requested_outputs(schema: TabularSchema, body: InferRequest) -> list[str]:
    """The outputs to answer (all, unless the request names some); raises for a name the model lacks."""
    known = [PREDICT, PROBABILITIES] if schema.task == "classifier" else [PREDICT]
    if not body.outputs:
        return known
    for o in body.outputs:
        if o.name not in known:
            raise InvalidRequest(f"This model has no output '{o.name}'; it has {', '.join(known)}.",
                                 param="outputs")
    return [o.name for o in body.outputs]


def infer_response(name: str, version: str, request_id: str | None, outputs: list[str], schema: TabularSchema,
                   predictions: np.ndarray, probabilities: np.ndarray | None) -> dict:
    """The infer answer; its data stay arrays (flat, row-major) for the encoder to write."""
    tensors = []
    for output in outputs:
        if output == PREDICT:
            tensors.append({"name": PREDICT, "datatype": prediction_datatype(schema), "shape": [len(predictions)],
                            "data": predictions})
        else:
            tensors.append({"name": PROBABILITIES, "datatype": "FP64", "shape": list(probabilities.shape),
                            "data": probabilities.reshape(-1)})
    body = {"model_name": name, "model_version": version, "outputs": tensors}
    return body if request_id is None else {"id": request_id} | body
