"""What the request path asks of a model kind: its operations (route, body type) and how it plans them.

The lifecycle (lifecycle.py) is written once; each kind's module (text.py, ...) lists its operations.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from inferd.gateway.charges import Plan
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import Deployment
from inferd.gateway.policy import KeyPolicy

Planner = Callable[[Deployment, KeyPolicy, Any, dict, ModelPrice], Plan]  # deployment, key, body, raw, price
OutputCap = Callable[[Plan, int, ModelPrice], Plan]  # the plan with at most N output units (degradation)


@dataclass(slots=True, frozen=True)
class Operation:
    name: str  # gen_ai.operation.name: chat | text_completion | embeddings ...
    path: str
    body_type: type[BaseModel]
    kind: str  # the deployment kind that serves it (Deployment.model.kind)
    plan: Planner
    cap_output: OutputCap | None = None  # None: the kind has no output to cap
