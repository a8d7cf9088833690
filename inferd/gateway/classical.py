"""The classical kind at the gateway: /v1/predict and the Open Inference Protocol's infer, counted in rows
and checked against the model's schema before any replica sees them; the v2 health and metadata routes.

Rows are what a classical request costs: the plan's prompt_tokens, so tokens-per-minute limits, budgets
(a deployment's input price is per million rows) and usage records count rows. The v2 routes name the
model in the path; a `versions/{version}` path gets that version of the name (its stable or its canary).
"""
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway.auth import authorization, client_address
from inferd.gateway.charges import Plan, check_request_limits
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import ClassicalModel, Deployment
from inferd.gateway.kinds import Operation
from inferd.gateway.policy import KeyPolicy
from inferd.protocol.classical import MAX_PREDICT_BODY_BYTES, PredictRequest, decode_body, feature_matrix
from inferd.protocol.errors import NotFound
from inferd.protocol.oip import InferRequest, infer_matrix, model_metadata, requested_outputs

KIND = "classical"
V2_MODEL = "/v2/models/{name}"
V2_VERSION = "/v2/models/{name}/versions/{version}"


def plan_predict(d: Deployment, key: KeyPolicy, body: PredictRequest, raw: dict, price: ModelPrice) -> Plan:
    """Every row checked as the replica checks it (a 400 naming the field), then counted. The replica gets
    the client's bytes unless the model it knows the deployment by must be written in."""
    feature_matrix(d.model.schema, body)
    upstream = d.upstream_model or d.name
    return _plan(d, key, body.num_rows, None if body.model in (None, upstream) else dict(raw, model=upstream),
                 price, "inputs")


def plan_infer(d: Deployment, key: KeyPolicy, body: InferRequest, raw: dict, price: ModelPrice) -> Plan:
    """The tensors checked against the schema; the replica gets the client's bytes on its own unversioned
    path (the gateway has already picked the version)."""
    requested_outputs(d.model.schema, body)
    infer_matrix(d.model.schema, body)
    plan = _plan(d, key, body.num_rows, None, price, "inputs")
    plan.path = f"/v2/models/{quote(d.upstream_model or d.name, safe='')}/infer"
    return plan


def _plan(d: Deployment, key: KeyPolicy, rows: int, upstream: dict | None, price: ModelPrice, param: str) -> Plan:
    check_request_limits(key, d.name, rows, None, param, unit="rows")
    return Plan(rows, 0, 0, price.cost_usd(rows, 0, 0), upstream, False)


BODY = {"max_body_bytes": MAX_PREDICT_BODY_BYTES, "decode": decode_body}  # 10 MB, parsed with orjson
OPERATIONS = (
    Operation("predict", "/v1/predict", PredictRequest, KIND, plan_predict, **BODY),
    Operation("infer", f"{V2_MODEL}/infer", InferRequest, KIND, plan_infer, model_param="name", **BODY),
    Operation("infer", f"{V2_VERSION}/infer", InferRequest, KIND, plan_infer, model_param="name", **BODY),
)


class OIPRoutes:
    """GET /v2, /v2/health/{live,ready} and /v2/models/{name}[/versions/{version}][/ready], for a key's
    models; authenticated as /v1/models is."""

    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v2", self.server_metadata, methods=["GET"]),
                Route("/v2/health/live", self.live, methods=["GET"]),
                Route("/v2/health/ready", self.ready, methods=["GET"]),
                Route(V2_MODEL, self.metadata, methods=["GET"]), Route(V2_VERSION, self.metadata, methods=["GET"]),
                Route(f"{V2_MODEL}/ready", self.model_ready, methods=["GET"]),
                Route(f"{V2_VERSION}/ready", self.model_ready, methods=["GET"])]

    async def server_metadata(self, request: Request) -> Response:
        await self._key(request)
        return JSONResponse({"name": "inferd", "version": "2", "extensions": []})

    async def live(self, request: Request) -> Response:
        await self._key(request)
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        await self._key(request)
        ds = self.gw.deployments
        ok = all(ds.servable(d) for d in ds.by_name.values())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metadata(self, request: Request) -> Response:
        d = await self._deployment(request)
        versions = [v.version for v in self.gw.deployments.versions(d.name)]
        m: ClassicalModel = d.model
        return JSONResponse(model_metadata(d.name, versions, m.platform, m.schema))

    async def model_ready(self, request: Request) -> Response:
        d = await self._deployment(request)
        ok = any(u.healthy and not u.draining for u in d.upstreams)
        return JSONResponse({"name": d.name, "ready": ok}, status_code=200 if ok else 503)

    async def _key(self, request: Request) -> KeyPolicy:
        return await self.gw.keys.authenticate(authorization(request), client_address(request))

    async def _deployment(self, request: Request) -> Deployment:
        """The classical deployment the path names, if the key may use it (else 404: it is not there for it)."""
        key = await self._key(request)
        name, version = request.path_params["name"], request.path_params.get("version")
        ds = self.gw.deployments
        d = None if not key.may_use(name) else ds.route(name, KIND, version) if version else ds.get(name)
        if d is None or d.model.kind != KIND:
            raise NotFound(f"Model '{name}'{f' version {version!r}' if version else ''} is not served here.",
                           code="model_not_found")
        return d
