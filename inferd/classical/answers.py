"""A classical replica's answers as JSON, written by orjson straight from the arrays (1,024 rows of
probabilities: a fraction of json.dumps' time). Floats go out as float64, so a float32 model's values
read back exactly; labels that are not numbers (strings) as lists."""
import numpy as np
import orjson
from starlette.responses import Response

from inferd.classical.runtime import Answer
from inferd.protocol import headers


def json_ready(values: np.ndarray) -> np.ndarray | list:
    if values.dtype.kind == "f":
        return np.ascontiguousarray(values, dtype=np.float64)
    if values.dtype.kind in "iub":
        return np.ascontiguousarray(values)
    return values.tolist()


def json_response(body: dict, status_code: int = 200, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status_code,
                    media_type="application/json", headers=extra_headers)


def predict_response(model: str, answer: Answer) -> Response:
    """POST /v1/predict's answer; its usage header counts rows, as the gateway counts them."""
    predictions, probabilities = answer
    body = {"object": "list", "model": model, "predictions": json_ready(predictions)}
    if probabilities is not None:
        body["probabilities"] = json_ready(probabilities)
    body["usage"] = {"rows": len(predictions)}
    return json_response(body, extra_headers=headers.usage_headers(len(predictions)))
