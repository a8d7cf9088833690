"""Admin API (/admin/*), guarded by the admin key: tenants, keys, usage, the reconciliation counters and the
deployments' whole model cards (with the server's paths, which a tenant's /v1/models leaves out). Changes
are audited in the store with who made them (admin-api@ADDRESS; the console passes its own actor to the same
methods: create_key, revoke_key, rollout)."""
import asyncio
import hmac
import time
from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.protocol.http import read_json
from inferd.protocol.errors import AuthenticationFailed, InvalidRequest, NotFound, PermissionDenied
from inferd.gateway.auth import client_address
from inferd.gateway.policy import PolicyError, TenantPolicy
from inferd.gateway.store import StoreError

TENANT_FIELDS = {"name", "limits", "model_limits", "weight", "priority_class", "default_deadline_ms", "queue_share",
                 "allowed_models", "budget_usd", "budget_period", "batch_queued_tokens"}
KEY_FIELDS = {"tenant", "name", "limits", "allowed_models", "priority_class"}


def tenant_json(t: TenantPolicy) -> dict:
    out = asdict(t)
    out["limits"] = t.limits.to_dict()
    out["model_limits"] = {m: lim.to_dict() for m, lim in t.model_limits.items()}
    return out


def routes(gateway) -> list[Route]:
    admin = Admin(gateway)
    return [Route("/admin/tenants", admin.tenants, methods=["GET", "POST"]),
            Route("/admin/tenants/{name}", admin.tenant, methods=["GET", "PATCH"]),
            Route("/admin/tenants/{name}/webhook-secret", admin.webhook_secret, methods=["GET"]),
            Route("/admin/tenants/{name}/webhook-secret/rotate", admin.webhook_secret, methods=["POST"]),
            Route("/admin/keys", admin.keys, methods=["GET", "POST"]),
            Route("/admin/keys/{key_id}", admin.revoke, methods=["DELETE"]),
            Route("/admin/usage", admin.usage, methods=["GET"]),
            Route("/admin/counters", admin.counters, methods=["GET"]),
            Route("/admin/models", admin.models, methods=["GET"]),
            Route("/admin/autoscaling", admin.autoscaling, methods=["GET"]),
            Route("/admin/rollouts", admin.rollouts, methods=["GET"]),
            Route("/admin/rollouts/{name}", admin.rollouts, methods=["GET"]),
            Route("/admin/rollouts/{name}/{action}", admin.rollout_action, methods=["POST"])]


class Admin:
    def __init__(self, gateway):
        self.gw = gateway

    async def tenants(self, request: Request) -> Response:
        self._check(request)
        if request.method == "GET":
            return JSONResponse({"data": [tenant_json(t) for t in await self._run(self.gw.store.tenants)]})
        body = await self._body(request, TENANT_FIELDS)
        created = await self._run(self.gw.store.create_tenant, **body, actor=_actor(request))
        return JSONResponse(tenant_json(created), status_code=201)

    async def tenant(self, request: Request) -> Response:
        self._check(request)
        name = request.path_params["name"]
        if request.method == "GET":
            return JSONResponse(tenant_json(await self._run(self.gw.store.tenant, name)))
        body = await self._body(request, TENANT_FIELDS - {"name"})
        return JSONResponse(tenant_json(await self._run(self.gw.store.update_tenant, name, **body,
                                                        actor=_actor(request))))

    async def webhook_secret(self, request: Request) -> Response:
        """The tenant's webhook signing secret (derived, never stored); POST .../rotate moves it to the next."""
        self._check(request)
        secrets, name = self.gw.webhook_secrets, request.path_params["name"]
        if not secrets.enabled:
            raise InvalidRequest("This gateway has no webhook master secret (--webhook-secret-file).",
                                 code="webhooks_disabled")
        tenant = await self._run(self.gw.store.tenant, name)
        if request.method == "POST":
            generation = await self._run(secrets.rotate, tenant.id)
            await self._run(self.gw.store.record_change, _actor(request), "webhook.rotate", name,
                            {"generation": generation})
        return JSONResponse({"tenant": name} | await self._run(secrets.shown, tenant.id))

    async def keys(self, request: Request) -> Response:
        self._check(request)
        if request.method == "GET":
            return JSONResponse({"data": await self._run(self.gw.store.keys, request.query_params.get("tenant"))})
        body = await self._body(request, KEY_FIELDS)
        return JSONResponse(await self.create_key(body, _actor(request)), status_code=201)

    async def revoke(self, request: Request) -> Response:
        self._check(request)
        return JSONResponse(await self.revoke_key(request.path_params["key_id"], _actor(request)))

    async def create_key(self, body: dict, actor: str) -> dict:
        """A new key from KEY_FIELDS; the answer holds the key itself, shown once."""
        body = dict(body)
        tenant = body.pop("tenant", None)
        if not tenant:
            raise InvalidRequest("'tenant' is a required property", param="tenant")
        policy, new = await self._run(self.gw.store.create_key, tenant, **body, actor=actor)
        return {"id": policy.id, "key": new.key, "tenant": tenant, "name": policy.name,
                "note": "the key is shown once; store it now"}

    async def revoke_key(self, key_id: str, actor: str) -> dict:
        if not await self._run(self.gw.store.revoke_key, key_id, actor=actor):
            raise NotFound("no live key with that id")
        return {"revoked": key_id}

    async def usage(self, request: Request) -> Response:
        self._check(request)
        q = request.query_params
        try:
            since, until = float(q.get("since_unix_s", 0)), float(q.get("until_unix_s", time.time() + 1))
        except ValueError:
            raise InvalidRequest("since_unix_s and until_unix_s are numbers (unix seconds)") from None
        rows = await self._run(self.gw.store.usage_summary, since, until, q.get("tenant"), q.get("gateway_id"))
        return JSONResponse({"data": rows})

    async def counters(self, request: Request) -> Response:
        """What this gateway handed to its usage writer since it started (compare: inferd usage reconcile)."""
        self._check(request)
        return JSONResponse({"gateway_id": self.gw.config.gateway_id, "started_unix_s": self.gw.started_unix_s,
                             "pending": self.gw.usage.pending} | asdict(self.gw.usage.counters))

    async def models(self, request: Request) -> Response:
        """Every deployment's card, canaries included, with its version and source_path."""
        self._check(request)
        return JSONResponse({"object": "list", "data": [d.card | {"version": d.version}
                                                         for d in self.gw.deployments.every()]})

    async def autoscaling(self, request: Request) -> Response:
        """Each autoscaled deployment: its target, last decision, signals and recent decisions."""
        self._check(request)
        return JSONResponse({"data": self.autoscalers()})

    def autoscalers(self) -> list[dict]:
        """The control plane's pools (the gateway's services with members and an autoscaler), newest decision
        first in recent_decisions (each: at_unix_s, replicas, desired, reason)."""
        out = []
        for s in self.gw.services:
            if hasattr(s, "members") and getattr(s, "autoscaler", None) is not None:
                signals = s.signals
                out.append({"name": s.deployment.name, "version": s.deployment.version, "target": s.target,
                            "decision": {"desired": s.decision.desired, "reason": s.decision.reason} if s.decision
                            else None, "signals": {k: getattr(signals, k) for k in signals.__slots__} if signals
                            else None, "restarts": s.restarts,
                            "recent_decisions": [{k: v for k, v in d.items() if k != "kind"}
                                                 for d in reversed(s.decisions)]})
        return out

    async def rollouts(self, request: Request) -> Response:
        """Canary rollouts: state, weight, the per-version comparison over the window and the decision."""
        self._check(request)
        name = request.path_params.get("name")
        rows = self._rollouts().status(name)
        if name is None:
            return JSONResponse({"data": rows})
        if not rows:
            raise NotFound(f"no canary for '{name}'")
        return JSONResponse(rows[0])

    async def rollout_action(self, request: Request) -> Response:
        """POST start (optional {"weight": share}), promote or rollback."""
        self._check(request)
        weight = None
        if request.path_params["action"] == "start" and await request.body():
            weight = (await self._body(request, {"weight"})).get("weight")
        return JSONResponse(await self.rollout(request.path_params["name"], request.path_params["action"], weight,
                                               _actor(request)))

    async def rollout(self, name: str, action: str, weight: float | None, actor: str) -> dict:
        """Start (at weight, else the spec's), promote or roll back a canary; audited as rollout.ACTION."""
        controller = self._rollouts()
        if action not in ("start", "promote", "rollback"):
            raise NotFound(f"no rollout action '{action}' (start, promote, rollback)")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)
                                   or not 0 < weight < 1):
            raise InvalidRequest("weight must be a number between 0 and 1", param="weight")
        try:
            status = controller.start_rollout(name, weight) if action == "start" else \
                getattr(controller, action)(name)
        except KeyError as exc:
            raise NotFound(exc.args[0]) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="invalid_rollout_state") from None
        await self._run(self.gw.store.record_change, actor, f"rollout.{action}", name,
                        {"canary_version": status["canary_version"], "weight": status["weight"]})
        return status

    # helpers

    def _rollouts(self):
        if self.gw.rollouts is None:
            raise NotFound("this gateway has no canaries (a deployment with role: canary in inferd serve --config)")
        return self.gw.rollouts

    def _check(self, request: Request) -> None:
        expected = self.gw.config.admin_key
        if not expected:
            raise PermissionDenied("The admin API is off; start the gateway with --admin-key.",
                                   code="admin_api_disabled")
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), expected.encode()):
            raise AuthenticationFailed("Incorrect admin key.", code="invalid_admin_key")

    async def _body(self, request: Request, allowed: set[str]) -> dict[str, Any]:
        body = await read_json(request, 1 << 20)
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        unknown = set(body) - allowed
        if unknown:
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
        return body

    async def _run(self, fn, *args, **kwargs):
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (StoreError, PolicyError, TypeError) as exc:
            raise InvalidRequest(str(exc)) from None


def _actor(request: Request) -> str:
    return f"admin-api@{client_address(request) or 'unknown'}"
