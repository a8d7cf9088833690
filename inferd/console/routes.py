"""The console's routes under /console on the gateway's port: pages, their JSON and live events, static files.

Every response carries a Content-Security-Policy that allows scripts, styles and connections from the gateway
only (no inline script, no CDN). Reads need a session; changes need an admin session, a POST, the session's
CSRF token and a same-origin request. Key and rollout changes go through the admin API's own methods
(gateway/admin.py), which audit them in the store with the session's actor.
"""
import asyncio
import csv
import html
import io
import json
import logging
import time
from datetime import date, datetime, timezone
from pathlib import Path
from urllib.parse import parse_qs

from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, \
    StreamingResponse
from starlette.routing import Route

from inferd.console import now, users
from inferd.console.signin import ADMIN, COOKIE, IDLE_TTL_S, MEMBER, Session, Sessions, csrf_ok
from inferd.console.sso import PENDING_S, STATE_COOKIE, SignInRefused, SingleSignOn
from inferd.console.window import COARSE_COUNT, COARSE_S, SAMPLE_S, Window
from inferd.gateway.admin import Admin, tenant_json
from inferd.gateway.auth import client_address
from inferd.gateway.charges import budget_period
from inferd.gateway.rollups import DAY_S, SUMS
from inferd.protocol.errors import APIError, AuthenticationFailed, InvalidRequest, PermissionDenied

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"console.js": "text/javascript", "console.css": "text/css", "uplot.min.js": "text/javascript",
                "uplot.min.css": "text/css"}  # uPlot 1.6.32 from npm (MIT: static/uplot.LICENSE)
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "same-origin",
    "cache-control": "no-store"}
EVENT_INTERVAL_S = 1.0
log = logging.getLogger(__name__)

HISTORY_S = COARSE_S * COARSE_COUNT  # what the History charts show (24 h)
SAVE_S = 60.0  # the History buckets are saved this often
PASSWORD_CHECKS = 2  # scrypt hashes computed at once (128 MiB each: console/users.py)
MAX_USAGE_DAYS = 366
EPOCH_ORDINAL = date(1970, 1, 1).toordinal()


class Console:
    """A gateway service (Gateway.services): it samples the gauges into its Window while the app runs."""

    def __init__(self, gateway, viewer_key: str | None = None):
        self.gw = gateway
        self.sessions = Sessions(gateway.config.admin_key, viewer_key)
        oidc = gateway.config.oidc
        self.sso = SingleSignOn(gateway.issuer, oidc) if oidc and oidc.client_id else None
        self.window = Window(lambda name, version: any(d.version == version for d in
                                                       gateway.deployments.versions(name)))
        self.admin = Admin(gateway)
        gateway.observers.append(self.window.observe)
        self._sampler: asyncio.Task | None = None
        self._password_checks = asyncio.Semaphore(PASSWORD_CHECKS)

    async def start(self, gateway) -> None:
        try:
            self.window.restore(await asyncio.to_thread(self.gw.store.history_since, time.time() - HISTORY_S))
        except SQLAlchemyError as exc:  # the store is down: History starts empty, requests are served
            log.warning("the console's History was not read from the store: %s", exc)
        self._sampler = asyncio.create_task(self._sample())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await self._save()

    async def _sample(self) -> None:
        saved = time.monotonic()
        while True:
            for d in self.gw.deployments.every():
                waiting = sum(s.length for s in d.queue.stats().values())
                kv = await now.kv_cache_usage(self.gw.client, d)
                self.window.sample(d.name, d.version, waiting, d.queue.inflight, sum(u.healthy for u in d.upstreams),
                                   kv)
            if time.monotonic() - saved >= SAVE_S:
                saved = time.monotonic()
                await self._save()
            await asyncio.sleep(SAMPLE_S)

    async def _save(self) -> None:
        """The History buckets of the last SAVE_S and more into the store (a crash loses at most that)."""
        now_s = time.time()
        try:
            await asyncio.to_thread(self.gw.store.save_history, self.gw.config.gateway_id,
                                    self.window.coarse_buckets(now_s - 2 * SAVE_S), now_s - HISTORY_S - COARSE_S)
        except SQLAlchemyError as exc:
            log.warning("the console's History was not saved in the store: %s", exc)

    def routes(self) -> list[Route]:
        get = [("", self.page), ("/events", self.events), ("/api/now", self.now), ("/api/tenants", self.tenants),
               ("/api/usage", self.usage), ("/usage.csv", self.usage_csv), ("/api/history", self.history),
               ("/api/rollouts", self.rollouts), ("/static/{name}", self.static), ("/oidc/sign-in", self.sso_begin),
               ("/oidc/callback", self.sso_finish)]
        post = [("/sign-in", self.sign_in), ("/sign-out", self.sign_out), ("/api/keys", self.create_key),
                ("/api/keys/{key_id}/revoke", self.revoke_key), ("/api/rollouts/{name}/{action}", self.rollout)]
        return ([Route(f"/console{p}", _secured(f), methods=["GET"]) for p, f in get]
                + [Route(f"/console{p}", _secured(f), methods=["POST"]) for p, f in post])

    # signing in and out

    async def page(self, request: Request) -> Response:
        session = await self._session(request)
        if session is None:
            enabled = self.sessions.enabled or bool(await asyncio.to_thread(self.gw.store.console_users))
            return HTMLResponse(signin_page(enabled, request.query_params.get("error"), self.sso is not None))
        return HTMLResponse(console_page(session))

    async def sign_in(self, request: Request) -> Response:
        """The admin or viewer key in `key`, or a console user's name in `user` and password in `key`."""
        _same_origin(request)
        address = client_address(request) or "unknown"
        form = await _form(request)
        name, secret = form.get("user", "").strip(), form.get("key", "")
        failures = self.sessions.failures
        if failures.retry_after_s(address) > 0 or (name and failures.retry_after_s(f"user:{name}") > 0):
            return RedirectResponse("/console?error=too_many_attempts", status_code=303)
        if name:
            async with self._password_checks:
                user = await asyncio.to_thread(users.check_sign_in, self.gw.store, name, secret)
            if user is None:
                failures.failed(address)
                failures.failed(f"user:{name}")  # guesses at one user from many addresses are limited too
                return RedirectResponse("/console?error=wrong_password", status_code=303)
            session = self.sessions.open(user["role"], address, user)
        else:
            session = self.sessions.sign_in(secret, address)
        if session is None:
            return RedirectResponse("/console?error=wrong_key", status_code=303)
        return _with_session(RedirectResponse("/console", status_code=303), session, request)

    async def sso_begin(self, request: Request) -> Response:
        """To the identity provider's sign-in (console/sso.py), with the state in a cookie it brings back."""
        if self.sso is None:
            return Response("not found", status_code=404)
        redirect_uri = self.sso.config.redirect_uri or f"{request.url.scheme}://{request.headers.get('host')}" \
                                                       "/console/oidc/callback"
        url, state = await self.sso.begin(redirect_uri)
        response = RedirectResponse(url, status_code=303)
        response.set_cookie(STATE_COOKIE, state, max_age=int(PENDING_S), path="/console/oidc", httponly=True,
                            samesite="lax", secure=request.url.scheme == "https")
        return response

    async def sso_finish(self, request: Request) -> Response:
        """The provider's redirect back: a session for the person it signed in, if a group of theirs maps to a
        role. The page it answers moves on to /console itself: a redirect from here would still count as the
        provider's navigation, and the browser would withhold the session's SameSite=Strict cookie."""
        if self.sso is None:
            return Response("not found", status_code=404)
        q = request.query_params
        try:
            if q.get("error"):
                raise SignInRefused("sso_denied")
            person = await self.sso.finish(q.get("state", ""), request.cookies.get(STATE_COOKIE), q.get("code", ""))
        except (SignInRefused, APIError) as exc:
            code = exc.args[0] if isinstance(exc, SignInRefused) else "sso_token"
            log.info("console sign-in through the identity provider refused: %s", code)
            response = RedirectResponse(f"/console?error={code}", status_code=303)
        else:
            session = self.sessions.open(person.role, client_address(request) or "unknown", sso=person.name,
                                         tenant=person.tenant)
            response = _with_session(HTMLResponse(_shell("Signed in", '<main class="signin"><p>Signed in. '
                                                         '<a href="/console">Continue</a></p></main>', None,
                                                         '<meta http-equiv="refresh" content="0;url=/console">')),
                                     session, request)
        response.delete_cookie(STATE_COOKIE, path="/console/oidc", httponly=True, samesite="lax")
        return response

    async def sign_out(self, request: Request) -> Response:
        session = await self._checked(request)
        self.sessions.sign_out(session.id)
        response = RedirectResponse("/console", status_code=303)
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
        return response

    # reads

    async def now(self, request: Request) -> Response:
        await self._operator(request)
        return JSONResponse(now.snapshot(self.gw, self.window))

    async def events(self, request: Request) -> Response:
        """The Now snapshot as server-sent events, every EVENT_INTERVAL_S, while the session lasts."""
        await self._operator(request)

        async def stream():
            while await self._session(request) is not None and not await request.is_disconnected():
                yield f"event: now\ndata: {json.dumps(now.snapshot(self.gw, self.window))}\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)
            yield "event: signed-out\ndata: {}\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def tenants(self, request: Request) -> Response:
        """Every tenant, key and the audit log; a member's session: its tenant and its keys only."""
        session = await self._reader(request)
        store, moment, mine = self.gw.store, time.time(), session.tenant if session.role == MEMBER else None
        reads = [asyncio.to_thread(store.tenants), asyncio.to_thread(store.keys, mine)]
        if mine is None:
            reads.append(asyncio.to_thread(store.audit, 50))
        tenants, keys, *audit = await asyncio.gather(*reads)
        rows = []
        for t in tenants:
            if mine is not None and t.name != mine:
                continue
            start, end = budget_period(t.budget_period, moment)
            spent = (await asyncio.to_thread(store.spent_by_tenant, start)).get(t.id, 0.0)
            rows.append(tenant_json(t) | {"spent_usd": spent, "period_start_unix_s": start, "period_end_unix_s": end})
        return JSONResponse({"tenants": rows, "keys": keys} | ({"audit": audit[0]} if audit else {}))

    async def usage(self, request: Request) -> Response:
        """The daily rows; for a session that sees the whole service, also what did not complete in the last
        24 h by model and reason (the History's buckets: every tenant's)."""
        session = await self._reader(request)
        started = time.perf_counter()
        rows = await self._usage_rows(request, session)
        reasons = self.window.reasons(time.time() - HISTORY_S) if session.role != MEMBER else None
        return JSONResponse({"data": rows, "query_ms": (time.perf_counter() - started) * 1000} |
                            ({"not_completed_24h": reasons} if reasons is not None else {}))

    async def usage_csv(self, request: Request) -> Response:
        rows = await self._usage_rows(request, await self._reader(request))
        out = io.StringIO()
        writer = csv.DictWriter(out, ["date", "tenant", "model", "priority_class", *SUMS], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"content-disposition": 'attachment; filename="inferd-usage.csv"'})

    async def history(self, request: Request) -> Response:
        await self._operator(request)
        fine = request.query_params.get("resolution") == "minute"
        return JSONResponse({"deployments": [{"name": d.name, "version": d.version,
                                              "points": self.window.history(d.name, d.version, fine)}
                                             for d in self.gw.deployments.every()]})

    async def rollouts(self, request: Request) -> Response:
        await self._operator(request)
        rows = self.gw.rollouts.status() if self.gw.rollouts is not None else []
        return JSONResponse({"rollouts": rows, "autoscaling": self.admin.autoscalers()})

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC_FILES:
            return Response("not found", status_code=404)
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name], headers={"cache-control": "no-cache"})

    # changes

    async def create_key(self, request: Request) -> Response:
        session = await self._change(request)
        body = await request.json()
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        fields = {k: body[k] for k in ("tenant", "name") if body.get(k)}
        return JSONResponse(await self.admin.create_key(fields, session.actor), status_code=201)

    async def revoke_key(self, request: Request) -> Response:
        session = await self._change(request)
        return JSONResponse(await self.admin.revoke_key(request.path_params["key_id"], session.actor))

    async def rollout(self, request: Request) -> Response:
        """start (optional {"weight": share}), promote or rollback: what `inferd rollout` does, as this session."""
        session = await self._change(request)
        body = await request.json() if await request.body() else {}
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        return JSONResponse(await self.admin.rollout(request.path_params["name"], request.path_params["action"],
                                                     body.get("weight"), session.actor))

    # helpers

    async def _session(self, request: Request) -> Session | None:
        """The request's live session; a console user's is confirmed against the store every USER_RECHECK_S."""
        session = self.sessions.find(request.cookies.get(COOKIE))
        if session is not None and self.sessions.recheck_due(session):
            user = await asyncio.to_thread(self.gw.store.console_user, session.user)
            if not self.sessions.confirmed(session, user):
                return None
        return session

    async def _reader(self, request: Request) -> Session:
        session = await self._session(request)
        if session is None:
            raise AuthenticationFailed("Sign in to the console first.", code="console_signed_out")
        return session

    async def _operator(self, request: Request) -> Session:
        """A session that sees the whole service (not a member's, which sees its tenant only)."""
        session = await self._reader(request)
        if session.role == MEMBER:
            raise PermissionDenied("A tenant member's session sees its tenant's usage and keys only.",
                                   code="console_tenant_only")
        return session

    async def _change(self, request: Request) -> Session:
        """The session that may make this change: signed in, an admin, same origin, the right CSRF token."""
        session = await self._checked(request)
        if session.role != ADMIN:
            raise PermissionDenied("This session may only read.", code="console_read_only")
        return session

    async def _checked(self, request: Request) -> Session:
        """A signed-in session's POST: same origin, the right CSRF token."""
        _same_origin(request)
        session = await self._reader(request)
        token = request.headers.get("x-csrf-token")
        if token is None and request.headers.get("content-type", "").startswith("application/x-www-form"):
            token = (await _form(request)).get("csrf_token")
        if not csrf_ok(session, token):
            raise PermissionDenied("Missing or wrong CSRF token.", code="csrf_token_invalid")
        return session

    async def _usage_rows(self, request: Request, session: Session) -> list[dict]:
        q = request.query_params
        try:
            until = _day(q["until"]) + 1 if q.get("until") else int(time.time() // DAY_S) + 1
            since = _day(q["since"]) if q.get("since") else until - 30
        except ValueError:
            raise InvalidRequest("since and until are dates (YYYY-MM-DD)") from None
        if not 0 < until - since <= MAX_USAGE_DAYS:
            raise InvalidRequest(f"since..until must span 1 to {MAX_USAGE_DAYS} days")
        tenant = session.tenant if session.role == MEMBER else q.get("tenant") or None
        rows = await asyncio.to_thread(self.gw.store.usage_daily, since * DAY_S, until * DAY_S, tenant)
        dates = {day: date.fromordinal(EPOCH_ORDINAL + day).isoformat() for day in range(since, until)}
        for r in rows:
            r["date"] = dates[r["day"]]
        return rows


async def _form(request: Request) -> dict[str, str]:
    """An application/x-www-form-urlencoded body of at most 4 KiB (the console's two forms)."""
    body = await request.body()
    if len(body) > 4096:
        raise InvalidRequest("form body too large")
    return {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}


def _day(text: str) -> int:
    return (datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=timezone.utc).date() - date(1970, 1, 1)).days


def _same_origin(request: Request) -> None:
    """A POST must come from a page of this gateway: its Origin (browsers send one on POST; "null" under a
    no-referrer policy, so the console sends same-origin) names our host."""
    origin = request.headers.get("origin")
    if origin is None or origin.split("://", 1)[-1] != request.headers.get("host"):
        raise PermissionDenied("Cross-origin request refused.", code="cross_origin")


def _with_session(response: Response, session: Session, request: Request) -> Response:
    response.set_cookie(COOKIE, session.id, max_age=int(IDLE_TTL_S), path="/console", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


def _secured(endpoint):
    async def wrapped(request: Request) -> Response:
        response = await endpoint(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response
    return wrapped


# pages (no inline script or style: console.js and console.css do the rest)

def _shell(title: str, body: str, script: str | None, meta: str = "") -> str:
    """The page; with script (console.js), uPlot's script and styles before it."""
    tags = "".join(f'<script src="/console/static/{s}"></script>' for s in ("uplot.min.js", script)) if script else ""
    styles = "".join(f'<link rel="stylesheet" href="/console/static/{s}">' for s in
                     (("uplot.min.css", "console.css") if script else ("console.css",)))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title} · inferd console</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">{meta}{styles}</head>'
            f'<body>{body}{tags}</body></html>')


ERRORS = {"wrong_key": "That key is not the admin or viewer key.",
          "wrong_password": "Wrong user name or password.",
          "too_many_attempts": "Too many failed sign-ins from this address; wait a few seconds.",
          "sso_denied": "The identity provider did not sign you in.",
          "sso_state": "That sign-in expired or did not start here; sign in again.",
          "sso_code": "The identity provider did not confirm the sign-in; sign in again.",
          "sso_token": "The identity provider's answer did not check out; sign in again.",
          "sso_no_role": "You are signed in at the identity provider, but none of your groups has a role here."}


def signin_page(enabled: bool, error: str | None, sso: bool = False) -> str:
    message = ERRORS.get(error or "", "") if enabled or sso else \
        "The console is off: start the gateway with --admin-key (and --console-viewer-key for read-only), or " \
        "add a user with `inferd console user add`, or set up sign-in through an identity provider (oidc)."
    provider = '<p><a class="button" id="sso-sign-in" href="/console/oidc/sign-in">Sign in with your identity ' \
               'provider</a></p>' if sso else ""
    return _shell("Sign in", f'''<main class="signin"><h1>inferd console</h1>{provider}
<form method="post" action="/console/sign-in" id="signin">
<label for="user">User name (leave empty to sign in with a key)</label>
<input type="text" name="user" id="user" autocomplete="username" autofocus>
<label for="key">Password, or the admin or viewer key</label>
<input type="password" name="key" id="key" autocomplete="current-password" required>
<button type="submit" id="signin-button">Sign in</button></form>
<p class="error" id="signin-error">{html.escape(message)}</p></main>''', None)


def console_page(session: Session) -> str:
    meta = (f'<meta name="csrf-token" content="{html.escape(session.csrf_token)}">'
            f'<meta name="console-role" content="{html.escape(session.role)}">')
    shown = ("tenants", "usage") if session.role == MEMBER else ("now", "tenants", "usage", "history", "rollouts")
    tabs = "".join(f'<a href="#{t}" data-tab="{t}">{t.capitalize()}</a>' for t in shown)
    return _shell("Console", f'''<header><strong>inferd console</strong><nav>{tabs}</nav>
<span class="who" id="who">{html.escape(session.shown_as)}</span>
<form method="post" action="/console/sign-out"><input type="hidden" name="csrf_token"
value="{html.escape(session.csrf_token)}"><button type="submit" id="sign-out">Sign out</button></form></header>
<main>{"".join(f'<section id="{t}"></section>' for t in shown)}</main>''', "console.js", meta)
