"""The rules gateway and replica both apply to a classical request: its shape, then every value against the
schema, each refusal a 400 naming the field."""
import math

import numpy as np
import pytest

from inferd.protocol.classical import Feature, PredictRequest, TabularSchema, decode_body, feature_matrix
from inferd.protocol.errors import InvalidRequest, to_api_error
from inferd.protocol.oip import InferRequest, infer_matrix, model_metadata, requested_outputs

SCHEMA = TabularSchema((Feature("age", "int64"), Feature("income", "float64", allow_nan=True),
                        Feature("member", "bool"), Feature("score", "float32")), "classifier", ("no", "yes"))
ROW = {"age": 41, "income": 52000.5, "member": True, "score": 0.25}


def matrix_of(**body) -> np.ndarray:
    return feature_matrix(SCHEMA, PredictRequest.model_validate(body))


def refusal(call, *args, **body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        call(*args, **body) if args else matrix_of(**body)
    return e.value


def test_rows_and_columns_give_the_same_matrix_in_schema_order():
    by_rows = matrix_of(inputs=[ROW, ROW | {"income": None, "age": 7}])
    by_columns = matrix_of(columns={"score": [0.25, 0.25], "member": [True, True], "income": [52000.5, None],
                                    "age": [41, 7]})
    assert by_rows.shape == (2, 4) and by_rows.dtype == np.float64
    np.testing.assert_array_equal(by_rows, by_columns)
    assert by_rows[0].tolist() == [41.0, 52000.5, 1.0, 0.25] and math.isnan(by_rows[1, 1])


@pytest.mark.parametrize("body, param, says", [
    ({"inputs": [ROW | {"extra": 1}]}, "inputs[0].extra", "unknown feature 'extra'"),
    ({"inputs": [ROW, {k: v for k, v in ROW.items() if k != "score"}]}, "inputs[1].score", "'score' is missing"),
    ({"inputs": [ROW, ROW | {"age": 41.5}]}, "inputs[1].age", "age is int64 and takes integers"),
    ({"inputs": [ROW | {"age": "41"}]}, "inputs[0].age", "is a string"),
    ({"inputs": [ROW | {"member": 1}]}, "inputs[0].member", "takes true or false"),
    ({"inputs": [ROW | {"score": True}]}, "inputs[0].score", "is a boolean"),
    ({"inputs": [ROW | {"score": None}]}, "inputs[0].score", "it may not be missing"),
    ({"inputs": [ROW | {"score": float("nan")}]}, "inputs[0].score", "is NaN"),
    ({"inputs": [ROW | {"income": float("inf")}]}, "inputs[0].income", "is infinite"),
    ({"inputs": [ROW | {"age": 2**60}]}, "inputs[0].age", "outside int64's range"),
    ({"inputs": [ROW, [1, 2, 3, 4]]}, "inputs[1]", "is a list"),
    ({"columns": {**{k: [v] for k, v in ROW.items()}, "age": ["x"]}}, "columns.age[0]", "is a string"),
    ({"columns": {"age": [1]}}, "columns.income", "'income' is missing"),
])
def test_bad_values_are_refused_naming_the_field(body, param, says):
    err = refusal(None, **body)
    assert err.status == 400 and err.param == param and says in err.message, err.message


@pytest.mark.parametrize("body, says", [
    ({}, "exactly one of"), ({"inputs": [ROW], "columns": {"age": [1]}}, "exactly one of"),
    ({"inputs": []}, "no rows"), ({"columns": {"age": [1, 2], "income": [1.0]}}, "same length"),
    ({"columns": {"age": 1}}, "must be a list"), ({"inputs": [ROW] * 65537}, "at most 65536"),
])
def test_the_shape_of_the_body_is_checked_before_the_schema(body, says):
    with pytest.raises(InvalidRequest) as e:
        PredictRequest.model_validate(body)
    assert says in e.value.message


def tensor(name, shape, datatype, data, **extra) -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data} | extra


def infer(*tensors, outputs=None) -> InferRequest:
    return InferRequest.model_validate({"inputs": list(tensors)} | ({"outputs": outputs} if outputs else {}))


def test_v2_tensors_a_matrix_or_one_per_feature():
    flat = infer(tensor("input", [2, 4], "FP64", [41, 52000.5, 1, 0.25, 7, 1.0, 0, 0.5]))
    nested = infer(tensor("input", [2, 4], "FP64", [[41, 52000.5, 1, 0.25], [7, 1.0, 0, 0.5]]))
    assert infer_matrix(SCHEMA, flat).tolist() == infer_matrix(SCHEMA, nested).tolist()
    per_feature = infer(tensor("age", [2], "INT64", [41, 7]), tensor("income", [2, 1], "FP32", [52000.5, 1.0]),
                        tensor("member", [2], "BOOL", [True, False]), tensor("score", [2], "FP64", [0.25, 0.5]))
    assert infer_matrix(SCHEMA, per_feature).tolist() == [[41, 52000.5, 1, 0.25], [7, 1.0, 0, 0.5]]
    assert per_feature.num_rows == 2


@pytest.mark.parametrize("tensors, param, says", [
    ([tensor("input", [2, 3], "FP64", [1] * 6)], "inputs.input.shape", "reads [rows, 4]"),
    ([tensor("input", [2, 4], "FP64", [1] * 7)], "inputs.input.shape", "holds 7 values"),
    ([tensor("input", [1, 4], "FP64", [1.5, 1, 1, 1])], "inputs.input.data[0].age", "takes whole numbers"),
    ([tensor("input", [1, 4], "STRING", ["a"] * 4)], "inputs.input.datatype", "'STRING'"),
    ([tensor("input", [1, 4], "INT64", [1, 2, 3.5, 4])], "inputs.input.data", "not an integer"),
    ([tensor("age", [1], "INT64", [1]), tensor("income", [1], "FP64", [1.0]), tensor("member", [1], "BOOL", [True]),
      tensor("bogus", [1], "FP64", [1.0])], "inputs.bogus", "unknown feature 'bogus'"),
    ([tensor("age", [1], "FP64", [1.0]), tensor("income", [1], "FP64", [1.0]), tensor("member", [1], "BOOL", [True]),
      tensor("score", [1], "FP64", [1.0])], "inputs.age.datatype", "takes INT8"),
    ([tensor("age", [2], "INT64", [1, 2]), tensor("income", [1], "FP64", [1.0]),
      tensor("member", [1], "BOOL", [True]), tensor("score", [1], "FP64", [1.0])], "inputs.", "same rows"),
    ([tensor("input", [1, 4], "FP64", [1] * 4, parameters={"binary_data_size": 32})], "inputs.input", "Binary"),
])
def test_bad_tensors_are_refused_naming_the_field(tensors, param, says):
    err = refusal(infer_matrix, SCHEMA, infer(*tensors))
    assert err.param.startswith(param) and says in err.message, (err.param, err.message)


def test_v2_outputs_and_metadata():
    one = tensor("input", [1, 4], "FP64", [1, 1, 1, 1])
    assert requested_outputs(SCHEMA, infer(one)) == ["predict", "predict_proba"]
    assert requested_outputs(SCHEMA, infer(one, outputs=[{"name": "predict"}])) == ["predict"]
    assert refusal(requested_outputs, SCHEMA, infer(one, outputs=[{"name": "nope"}])).param == "outputs"
    meta = model_metadata("m", ["v1"], "sklearn", SCHEMA)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 4]}]
    assert meta["outputs"][0]["datatype"] == "BYTES" and meta["outputs"][1]["shape"] == [-1, 2]
    assert TabularSchema.from_dict(SCHEMA.as_dict()) == SCHEMA


def test_bodies_are_strict_json():
    assert decode_body(b'{"inputs": [{"a": null, "b": 1.5}]}') == {"inputs": [{"a": None, "b": 1.5}]}
    for bad in (b'{"inputs": [{"a": NaN}]}', b'{"inputs": [{"a": Infinity}]}', b"{"):
        with pytest.raises(ValueError) as e:
            decode_body(bad)
        assert to_api_error(e.value).code == "invalid_json"
