"""What the gateway serves: deployments (one per model name and version) and the replicas behind each.

A deployment holds what every model kind shares (name, version, replicas, router, queue, fallbacks, card)
and its kind's own part (`model`: for text, the tokenizer and context length). Which replica serves a
request is the router's choice (inferd.router).
"""
import time
from dataclasses import dataclass, field

import httpx

from inferd.gateway.admission import AdmissionQueue
from inferd.gateway.degrade import Degrader
from inferd.gateway.response_cache import ResponseCache
from inferd.protocol.classical import TabularSchema
from inferd.protocol.embeddings import BatchTokenizer, EmbeddingShape
from inferd.protocol.policy import ObservationSpec, websocket_path
from inferd.protocol.tokenizer import Tokenizer
from inferd.router.router import Router


@dataclass(slots=True, frozen=True)
class TextModel:
    """The text kind's part of a deployment: how its requests are counted and bounded."""
    tokenizer: Tokenizer
    max_model_len: int
    kind: str = "text"

    def card(self) -> dict:
        return {"kind": self.kind, "max_model_len": self.max_model_len}


@dataclass(slots=True, frozen=True)
class EmbeddingModel:
    """The embedding kind's part: its tokenizer (to count inputs) and the shape of its inputs and outputs."""
    tokenizer: BatchTokenizer
    shape: EmbeddingShape
    truncate: bool = False  # the deployment's default for requests that do not say
    kind: str = "embedding"

    def card(self) -> dict:
        s = self.shape
        return {"kind": self.kind, "dimensions": s.dimensions, "max_input_tokens": s.max_input_tokens,
                "matryoshka": s.matryoshka}


@dataclass(slots=True, frozen=True)
class ClassicalModel:
    """The classical kind's part: the input schema requests are checked against (rows are what it counts)."""
    schema: TabularSchema
    format: str = ""  # onnx | xgboost | lightgbm | skops | pickle
    platform: str = ""  # the Open Inference Protocol's name for what runs it
    kind: str = "classical"

    def card(self) -> dict:
        return {"kind": self.kind, "task": self.schema.task, "format": self.format, "platform": self.platform,
                "schema": self.schema.as_dict()}


@dataclass(slots=True, frozen=True)
class PolicyModel:
    """The robot-policy kind's part: what a session hears first and what its observations are checked against."""
    metadata: dict  # the policy's: action_horizon, action_dim, control_hz, observation_spec, ...
    spec: ObservationSpec
    max_frame_bytes: int
    max_sessions: int  # per replica
    idle_timeout_s: float
    kind: str = "policy"

    @property
    def horizon(self) -> int:
        return self.metadata["action_horizon"]

    @property
    def control_hz(self) -> float:
        return self.metadata["control_hz"]

    def card(self) -> dict:
        m = self.metadata
        return {"kind": self.kind, "action_horizon": m["action_horizon"], "action_dim": m["action_dim"],
                "control_hz": m["control_hz"], "observation_spec": self.spec.as_dict(),
                "max_frame_bytes": self.max_frame_bytes}


ModelKind = TextModel | EmbeddingModel | ClassicalModel | PolicyModel
ADMIN_ONLY = ("source_path",)  # the server's own files: in the card the admin API shows, not in a tenant's


@dataclass(slots=True, eq=False)
class Upstream:
    """One replica: ours, or any OpenAI-compatible base URL (…/v1 is appended by the caller)."""
    base_url: str
    api_key: str | None = None
    name: str = ""
    healthy: bool = True
    draining: bool = False  # being scaled down: no new requests, running ones finish (inferd.control.pool)
    inflight: int = 0  # requests running there (enter/leave)
    inflight_tokens: int = 0  # their reserved tokens
    transport: httpx.AsyncBaseTransport | None = None  # its own (a provider's protocol: providers.py); None: the gateway's

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        self.name = self.name or self.base_url

    def enter(self, tokens: int) -> None:
        self.inflight += 1
        self.inflight_tokens += tokens

    def leave(self, tokens: int) -> None:
        assert self.inflight > 0
        self.inflight -= 1
        self.inflight_tokens -= tokens


@dataclass(slots=True, eq=False)
class Deployment:
    name: str
    model: ModelKind
    upstreams: list[Upstream]
    queue: AdmissionQueue
    version: str = "v1"
    upstream_model: str | None = None  # the model id the upstream expects, if not `name`
    internal_headers: bool = True  # ours (x-inferd-* headers, usage events) or an external server
    runtime: str = "inferd"  # what its replicas run: inferd | vllm | llama.cpp (started by inferd); openai | anthropic
    card: dict = field(default_factory=dict)  # GET /admin/models; a tenant's /v1/models: tenant_card()
    router: Router = field(default_factory=Router)
    fallbacks: list[str] = field(default_factory=list)  # deployments that take the requests this one fails
    degrader: Degrader | None = None  # its degradation ladder, if it has one
    response_cache: ResponseCache | None = None  # its exact-match answers (response_cache.py); None: off

    def __post_init__(self):
        self.card = ({"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "inferd"}
                     | self.model.card() | {k: v for k, v in self.card.items() if k != "id"})
        if self.model.kind == "policy":
            self.card["websocket_path"] = websocket_path(self.name)

    def tenant_card(self) -> dict:
        """What a key holder sees of the model (GET /v1/models): name, kind, digests, limits; no server paths."""
        return {k: v for k, v in self.card.items() if k not in ADMIN_ONLY}

    def pick(self, prompt_ids: list[int], namespace: str, exclude: list[Upstream] = ()) -> Upstream:
        return self.router.pick([u for u in self.upstreams if u not in exclude] or self.upstreams,
                                prompt_ids, namespace)

    def describe(self, card: dict) -> None:
        """What a replica's /v1/models says of the model (context length, source, digests) joins the card."""
        if card.get("max_model_len") and isinstance(self.model, TextModel):
            self.model = TextModel(self.model.tokenizer, card["max_model_len"])
        self.card |= self.model.card() | {k: v for k, v in card.items() if k in ("source_path", "digests")}


@dataclass(slots=True)
class Deployments:
    by_name: dict[str, Deployment] = field(default_factory=dict)  # the stable version of each name
    defaults: dict[str, str] = field(default_factory=dict)  # kind -> the name a request without a model gets
    canaries: dict[str, Deployment] = field(default_factory=dict)  # a second version beside by_name[name]
    weights: dict[str, float] = field(default_factory=dict)  # share of a name's requests its canary takes
    credit: dict[str, float] = field(default_factory=dict)  # the canary's share owed so far (exact, not random)

    def add(self, deployment: Deployment, canary: bool = False) -> None:
        if canary:
            self.canaries[deployment.name] = deployment
            return
        self.by_name[deployment.name] = deployment
        self.defaults.setdefault(deployment.model.kind, deployment.name)

    def get(self, name: str) -> Deployment | None:
        return self.by_name.get(name)

    def versions(self, name: str) -> list[Deployment]:
        """The stable version of name, then its canary if it has one."""
        return [d for d in (self.by_name.get(name), self.canaries.get(name)) if d is not None]

    def every(self) -> list[Deployment]:
        """Every deployment, canaries included."""
        return [*self.by_name.values(), *self.canaries.values()]

    def servable(self, d: Deployment) -> bool:
        """A healthy replica, none at all (scaled to zero: a request starts one), or a fallback that is."""
        def up(x: Deployment) -> bool:
            return not x.upstreams or any(u.healthy for u in x.upstreams)
        return up(d) or any(up(f) for f in map(self.by_name.get, d.fallbacks) if f is not None)

    def stable(self, name: str | None, kind: str = "text") -> Deployment | None:
        """The stable version of `name` (None: the kind's first deployment), counting no canary share."""
        return self.get(name or self.defaults.get(kind, ""))

    def route(self, name: str | None, kind: str = "text", version: str | None = None) -> Deployment | None:
        """The version that serves one request for `name` (None: the kind's first deployment): every
        1/weight-th goes to its canary, the rest to the stable one; a request that names a version gets it."""
        stable = self.stable(name, kind)
        if version is not None:
            return next((d for d in self.versions(stable.name) if d.version == version), None) if stable else None
        weight = self.weights.get(stable.name, 0.0) if stable is not None else 0.0
        if weight <= 0:
            return stable
        credit = self.credit.get(stable.name, 0.0) + weight
        canary = self.canaries.get(stable.name) if credit >= 1 else None
        self.credit[stable.name] = credit - 1 if canary is not None else credit
        return canary or stable

    def promote(self, name: str) -> Deployment:
        """The canary becomes the name's stable version; the old stable one is returned (out of routing)."""
        self.weights.pop(name, None)
        old, self.by_name[name] = self.by_name[name], self.canaries[name]
        del self.canaries[name]
        return old

    def drop_canary(self, name: str) -> Deployment:
        self.weights.pop(name, None)
        return self.canaries.pop(name)
