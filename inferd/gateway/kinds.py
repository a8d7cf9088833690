"""What the request path asks of a model kind: its operations (route, body type) and how it plans them.

An operation's model is the body's `model`, or a path parameter (the Open Inference Protocol's
/v2/models/{name}[/versions/{version}]/infer: a `version` parameter picks that version of the name).

The lifecycle (lifecycle.py) is written once; each kind's module (text.py, ...) lists its operations.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from inferd.gateway.charges import Plan
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import Deployment
from inferd.gateway.policy import KeyPolicy
from inferd.protocol.http import decode_json

Planner = Callable[[Deployment, KeyPolicy, Any, dict, ModelPrice], Plan]  # deployment, key, body, raw, price
OutputCap = Callable[[Plan, int, ModelPrice], Plan]  # the plan with at most N output units (degradation)


class Answer(Protocol):
    """An answer in another API than the replica's (Anthropic's messages over chat completions)."""
    def whole(self, status: int, content: bytes) -> tuple[int, bytes]: ...
    def events(self, data: bytes) -> bytes: ...  # whole SSE events of the replica's stream
    def end(self) -> bytes: ...  # the stream's last bytes, once its records are written


@dataclass(slots=True, frozen=True)
class Operation:
    name: str  # gen_ai.operation.name: chat | text_completion | embeddings ...
    path: str
    body_type: type[BaseModel]
    kind: str  # the deployment kind that serves it (Deployment.model.kind)
    plan: Planner
    cap_output: OutputCap | None = None  # None: the kind has no output to cap
    model_param: str | None = None  # the path parameter naming the model (None: the body's `model`)
    max_body_bytes: int | None = None  # the kind's own cap, below the gateway's
    decode: Callable[[bytes], Any] = decode_json  # the body's parser
    answer: Callable[[Plan], Answer] | None = None  # None: the replica's answer as it is
