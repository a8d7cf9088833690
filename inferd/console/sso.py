"""The console's sign-in through an OpenID Connect identity provider: the authorization-code flow with PKCE.

    begin     GET /console/oidc/sign-in: a random state, nonce and PKCE verifier kept here for PENDING_S (the
              state also in a cookie, SameSite=Lax, so the provider's redirect back carries it), then a redirect
              to the provider's authorization endpoint
    finish    GET /console/oidc/callback?code&state: the state must match the cookie's and be pending; the code is
              exchanged at the token endpoint (Authlib's client, with the verifier and the client's secret), and
              the ID token checked (gateway/oidc.py: signature, issuer, audience = the client id, expiry) with
              its nonce; its groups claim picks the role (admin before viewer before member; a member sees the
              tenant its tenant claim names). No group mapped: no session.

People need no console user of their own: anyone the provider signs in with a mapped group gets a session.
"""
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from authlib.integrations.httpx_client import AsyncOAuth2Client

from inferd.gateway.oidc import Issuer, OIDCConfig

STATE_COOKIE = "inferd_oidc_state"
PENDING_S = 600.0
MAX_PENDING = 1000
RANK = ("admin", "viewer", "member")


class SignInRefused(Exception):
    """Why a sign-in did not give a session (the sign-in page's error code)."""


@dataclass(slots=True, frozen=True)
class Identity:
    name: str
    role: str
    tenant: str | None  # a member's


@dataclass(slots=True, frozen=True)
class _Pending:
    nonce: str
    verifier: str
    redirect_uri: str
    at_s: float


class SingleSignOn:
    def __init__(self, issuer: Issuer, config: OIDCConfig):
        self.issuer, self.config = issuer, config
        self._pending: OrderedDict[str, _Pending] = OrderedDict()

    def _client(self, redirect_uri: str) -> AsyncOAuth2Client:
        return AsyncOAuth2Client(self.config.client_id, self.config.client_secret, scope=" ".join(self.config.scopes),
                                 redirect_uri=redirect_uri, code_challenge_method="S256",
                                 token_endpoint_auth_method="client_secret_basic" if self.config.client_secret
                                 else "none", timeout=10.0)

    async def begin(self, redirect_uri: str) -> tuple[str, str]:
        """(the provider's URL to send the browser to, the state for the cookie)."""
        state, nonce, verifier = (secrets.token_urlsafe(32) for _ in range(3))
        async with self._client(redirect_uri) as client:
            url, _ = client.create_authorization_url(await self.issuer.endpoint("authorization_endpoint"),
                                                     state=state, nonce=nonce, code_verifier=verifier)
        self._pending[state] = _Pending(nonce, verifier, redirect_uri, time.monotonic())
        while len(self._pending) > MAX_PENDING or (
                self._pending and time.monotonic() - next(iter(self._pending.values())).at_s > PENDING_S):
            self._pending.popitem(last=False)
        return url, state

    async def finish(self, state: str, cookie_state: str | None, code: str) -> Identity:
        pending = self._pending.pop(state, None) if state else None
        if pending is None or cookie_state != state or time.monotonic() - pending.at_s > PENDING_S:
            raise SignInRefused("sso_state")
        async with self._client(pending.redirect_uri) as client:
            try:
                token = await client.fetch_token(await self.issuer.endpoint("token_endpoint"), code=code,
                                                 code_verifier=pending.verifier)
            except Exception as exc:  # the provider refused the code (Authlib's OAuthError) or did not answer
                raise SignInRefused("sso_code") from exc
        if "id_token" not in token:
            raise SignInRefused("sso_code")
        claims = await self.issuer.check(token["id_token"], self.config.client_id)
        if not secrets.compare_digest(str(claims.get("nonce", "")), pending.nonce):
            raise SignInRefused("sso_state")
        return self.identity(claims)

    def identity(self, claims: dict) -> Identity:
        groups = claims.get(self.config.groups_claim) or []
        groups = [groups] if isinstance(groups, str) else groups
        roles = {self.config.roles[g] for g in groups if isinstance(g, str) and g in self.config.roles}
        role = next((r for r in RANK if r in roles), None)
        tenant = claims.get(self.config.tenant_claim)
        if role is None or (role == "member" and not (isinstance(tenant, str) and tenant)):
            raise SignInRefused("sso_no_role")
        name = next((str(claims[c]) for c in ("preferred_username", "email", "sub") if claims.get(c)), "unknown")
        return Identity(name[:64], role, tenant if role == "member" else None)
