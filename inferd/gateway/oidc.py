"""Tokens from an OpenID Connect identity provider, beside inferd's keys (docs/sign-in.md).

The provider's discovery document and signing keys (its JWKS) are read at start and kept. A token signed by a
key id the set lacks reads the keys again (at most every REFETCH_S): that is how a rotated key is taken. The
set is read again every JWKS_TTL_S in the background, so a key the provider dropped stops working.

A token is checked by joserfc: its signature by one of those keys with an allowed algorithm, then its issuer,
audience and expiry (with the configured clock skew allowed, 30 s by default). A checked token is kept until it expires (at most
MAX_TOKENS of them), so an app that sends the same token with each request pays for its signature once; once the
provider stops publishing a key, the tokens kept are checked again.

The API: an access token's `aud` must be the configured audience, and its tenant claim names the tenant its
calls count against (the tenant's limits, budget, prices and usage records, as for that tenant's keys). Its
identity on the records is `tok_` and a hash of issuer and subject. The console's sign-in (console/sso.py)
checks ID tokens with the same keys.
"""
import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx
from joserfc import jwt
from joserfc.errors import ExpiredTokenError, InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet
from joserfc.jwt import JWTClaimsRegistry

from inferd.gateway.policy import KeyPolicy, TenantPolicy
from inferd.gateway.store import UNAVAILABLE, Store, StoreError
from inferd.protocol.errors import AuthenticationFailed, PermissionDenied, ServiceUnavailable

log = logging.getLogger(__name__)

ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA")
REFETCH_S = 2.0  # the provider's keys are read at most this often (an unknown key id, a provider that was down)
JWKS_TTL_S = 600.0
FETCH_TIMEOUT_S = 5.0
MAX_TOKENS = 10_000  # checked tokens kept until they expire; beyond, the oldest is dropped
TENANT_TTL_S = 5.0  # a token's tenant's policy is read again after this (in the background while it serves)
ROLES = ("admin", "viewer", "member")  # what a group may map to (member: of the tenant its claim names)


@dataclass(slots=True, frozen=True)
class OIDCConfig:
    issuer: str
    audience: str | None = None  # the API's: its access tokens' `aud`; None: the API takes keys only
    tenant_claim: str = "inferd_tenant"  # names the tenant a token's calls count against
    client_id: str | None = None  # the console's client at the provider; None: no sign-in through it
    client_secret: str | None = field(default=None, repr=False)  # None: a public client (PKCE only)
    groups_claim: str = "groups"
    roles: dict[str, str] = field(default_factory=dict)  # a group in the ID token: admin, viewer or member
    scopes: tuple[str, ...] = ("openid", "profile", "groups")
    redirect_uri: str | None = None  # default: /console/oidc/callback on the host the browser reached
    leeway_s: int = 30  # clock skew allowed on expiry

    def __post_init__(self):
        if not self.issuer.startswith(("https://", "http://")):
            raise ValueError(f"oidc.issuer: an http(s) URL, not {self.issuer!r}")
        for group, role in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"oidc.roles.{group}: one of {', '.join(ROLES)}, not {role!r}")
        if self.audience is None and self.client_id is None:
            raise ValueError("oidc: set audience (tokens on the API), client_id (the console's sign-in), or both")


class Issuer:
    """The provider's endpoints and signing keys, and the checks of its tokens."""

    def __init__(self, issuer: str, leeway_s: int = 30, client: httpx.AsyncClient | None = None):
        self.issuer, self.leeway_s = issuer.rstrip("/"), leeway_s
        self._client = client or httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)
        self.metadata: dict = {}
        self._keys: KeySet | None = None
        self.generation = 0  # counts the times a key the provider published was dropped
        self._fetched_s = self._tried_s = float("-inf")  # the last read of its keys that worked; the last tried
        self._fetching: asyncio.Future | None = None

    async def start(self) -> None:
        """Reads its keys now if it can; a provider that does not answer is tried again when a token comes."""
        try:
            await self._refresh()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("the identity provider %s did not answer at start: %s", self.issuer, exc)

    async def close(self) -> None:
        await self._client.aclose()

    async def endpoint(self, name: str) -> str:
        """A URL from its discovery document (authorization_endpoint, token_endpoint)."""
        if not self.metadata:
            await self._refresh_or_unavailable()
        return self.metadata[name]

    def check_cached_keys(self, token: str, audience: str) -> dict:
        """The token's claims, checked with the keys held now (raises InvalidKeyIdError for a key it lacks)."""
        if self._keys is None:
            raise InvalidKeyIdError()
        decoded = jwt.decode(token, self._keys, algorithms=list(ALGORITHMS))
        JWTClaimsRegistry(leeway=self.leeway_s, iss={"essential": True, "value": self.issuer},
                          aud={"essential": True, "value": audience},
                          exp={"essential": True}).validate(decoded.claims)
        return decoded.claims

    async def check(self, token: str, audience: str) -> dict:
        """The token's claims once signature, issuer, audience and expiry hold; else AuthenticationFailed."""
        now = time.monotonic()
        if now - self._fetched_s > JWKS_TTL_S and now - self._tried_s > REFETCH_S and self._fetching is None:
            self._fetching = asyncio.ensure_future(self._refresh())  # in the background: these keys serve now
            self._fetching.add_done_callback(_quiet)
        try:
            try:
                return self.check_cached_keys(token, audience)
            except InvalidKeyIdError:
                if self._keys is not None and time.monotonic() - self._tried_s < REFETCH_S:
                    raise  # (with no keys at all: each token tries the provider, one read at a time, or is a 503)
                await self._refresh_or_unavailable()
                return self.check_cached_keys(token, audience)
        except ExpiredTokenError:
            raise AuthenticationFailed("The token has expired.", code="invalid_token") from None
        except InvalidKeyIdError:
            raise AuthenticationFailed("The token is signed by a key the identity provider does not publish.",
                                       code="invalid_token") from None
        except JoseError as exc:
            reason = f"{exc.error}: {exc.description}" if exc.description else exc.error
            raise AuthenticationFailed(f"The token is not valid here ({reason}).", code="invalid_token") from None

    async def _refresh_or_unavailable(self) -> None:
        try:
            if self._fetching is None:
                self._fetching = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._fetching)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("the identity provider %s did not answer: %s", self.issuer, exc)
            raise ServiceUnavailable("The identity provider could not be reached to check the token.",
                                     code="identity_provider_unavailable") from None

    async def _refresh(self) -> None:
        self._tried_s = time.monotonic()
        try:
            if not self.metadata:
                found = (await self._get(f"{self.issuer}/.well-known/openid-configuration"))
                if found.get("issuer", "").rstrip("/") != self.issuer:
                    raise ValueError(f"its discovery document names another issuer ({found.get('issuer')!r})")
                self.metadata = found
            keys = KeySet.import_key_set(await self._get(self.metadata["jwks_uri"]))
            if self._keys is not None and {k.kid for k in self._keys} - {k.kid for k in keys}:
                self.generation += 1
            self._keys, self._fetched_s = keys, time.monotonic()
        finally:
            self._fetching = None

    async def _get(self, url: str) -> dict:
        response = await self._client.get(url)
        response.raise_for_status()
        return response.json()


def _quiet(future: asyncio.Future) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("the identity provider's keys were not read again: %s", exc)


def stored_key_required(key: KeyPolicy, what: str) -> None:
    """Work that runs later as its key (batches, async jobs: the runners find the key in the store again) needs
    a stored key: a token expires, and its holder is not in the store."""
    if key.from_token:
        raise PermissionDenied(f"{what} run after the request, as its API key: send an inferd API key, not a token.",
                               code="api_key_required")


def looks_like_token(credential: str) -> bool:
    """A JWT (three base64url parts, a JSON header): never one of inferd's keys."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class TokenKeys:
    """Access tokens on the API, each as the KeyPolicy of its subject in the tenant its claim names."""

    def __init__(self, issuer: Issuer, config: OIDCConfig, store: Store):
        self.issuer, self.config, self.store = issuer, config, store
        # token: (exp, tenant, key, the issuer's key generation it was checked in)
        self._tokens: OrderedDict[str, tuple[float, str, KeyPolicy, int]] = OrderedDict()
        self._tenants: dict[str, tuple[float, TenantPolicy | None]] = {}  # name: (read at, policy)
        self._reading: dict[str, asyncio.Future] = {}

    def cached(self, token: str) -> KeyPolicy | None:
        """The policy of a token checked before and not yet expired, with its tenant's current policy."""
        entry = self._tokens.get(token)
        if entry is None or entry[0] + self.issuer.leeway_s < time.time() or entry[3] != self.issuer.generation:
            return None
        tenant = self._tenant_now(entry[1])
        if tenant is None:
            return None
        key = entry[2]
        if key.tenant is not tenant:  # the tenant's settings were read again
            key = KeyPolicy(key.id, tenant, key.name, from_token=True)
            self._tokens[token] = (*entry[:2], key, entry[3])
        return key

    async def authenticate(self, token: str) -> KeyPolicy:
        if (key := self.cached(token)) is not None:
            return key
        generation = self.issuer.generation
        claims = await self.issuer.check(token, self.config.audience)
        tenant_name = claims.get(self.config.tenant_claim)
        if not isinstance(tenant_name, str) or not tenant_name:
            raise AuthenticationFailed(f"The token has no '{self.config.tenant_claim}' claim naming its tenant.",
                                       code="invalid_token")
        tenant = await self._tenant(tenant_name)
        if tenant is None and tenant_name not in self._tenants:
            raise ServiceUnavailable("The store could not be read to find the token's tenant.",
                                     code="store_unavailable")
        if tenant is None:
            raise AuthenticationFailed(f"The token's tenant '{tenant_name}' does not exist here.",
                                       code="invalid_token")
        subject = str(claims.get("sub") or claims.get("client_id") or "")
        key_id = "tok_" + hashlib.sha256(f"{self.issuer.issuer}\n{subject}".encode()).hexdigest()[:16]
        key = KeyPolicy(key_id, tenant, subject[:64], from_token=True)
        self._tokens[token] = (float(claims["exp"]), tenant_name, key, generation)
        if len(self._tokens) > MAX_TOKENS:
            self._tokens.popitem(last=False)
        return key

    def _tenant_now(self, name: str) -> TenantPolicy | None:
        """The cached policy (read again in the background once older than TENANT_TTL_S)."""
        read_s, policy = self._tenants.get(name, (float("-inf"), None))
        if time.monotonic() - read_s > TENANT_TTL_S and name not in self._reading:
            self._reading[name] = asyncio.ensure_future(self._read_tenant(name))
        return policy

    async def _tenant(self, name: str) -> TenantPolicy | None:
        if name in self._tenants:  # None: a name the store did not have when last read
            return self._tenant_now(name)
        if name not in self._reading:
            self._reading[name] = asyncio.ensure_future(self._read_tenant(name))
        return await asyncio.shield(self._reading[name])

    async def _read_tenant(self, name: str) -> TenantPolicy | None:
        try:
            policy = await asyncio.to_thread(self.store.tenant, name)
        except StoreError:
            policy = None
        except UNAVAILABLE as exc:  # the store is down: the policy held (if any) serves on, tried again in a while
            log.warning("tenant %s not read for a token: %s", name, exc)
            if name not in self._tenants:
                return None
            self._tenants[name] = (time.monotonic(), self._tenants[name][1])
            return self._tenants[name][1]
        finally:
            self._reading.pop(name, None)
        self._tenants[name] = (time.monotonic(), policy)
        return policy
