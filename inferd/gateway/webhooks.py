"""Webhooks: an async job's result POSTed to the URL its request named, signed by the Standard Webhooks scheme.

    webhook-id         the job's id (the same on every attempt: receivers drop repeats by it)
    webhook-timestamp  unix seconds of this attempt
    webhook-signature  v1,<base64 of HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>  (and, for
                       webhook_rotation_grace_s after a rotation, a second one with the previous secret)

A tenant's secret is never stored: it is HMAC-SHA256(master secret, "{tenant id}:{generation}"), the master
secret from the gateway's settings (one for every gateway on a store), the generation a counter in the store
(tables.webhook_secrets) that rotation moves on. An admin reads it as "whsec_" + base64 (the scheme's form).

URL policy (check_url): http or https only, no user:password in the URL (it would be stored), at most
MAX_URL_CHARS; every address the host resolves to must be public, or inside one of the networks the operator
allows (GatewayConfig.webhook_allow_networks, e.g. 10.0.0.0/8 or 127.0.0.0/8: none by default, so loopback,
private, link-local and reserved addresses are refused). Checked when the job is submitted and again before
each attempt; redirects are not followed. A name that resolves differently between the check and the connect
is not caught.
"""
import base64
import hashlib
import hmac
import ipaddress
import socket
import time
from urllib.parse import urlsplit

from sqlalchemy import Engine, insert, select, update

from inferd.gateway.tables import webhook_secrets
from inferd.protocol.errors import InvalidRequest

MAX_URL_CHARS = 2048
SECRET_PREFIX = "whsec_"


# signing

def tenant_secret(master: bytes, tenant_id: str, generation: int) -> bytes:
    return hmac.new(master, f"{tenant_id}:{generation}".encode(), hashlib.sha256).digest()


def secret_text(secret: bytes) -> str:
    return SECRET_PREFIX + base64.b64encode(secret).decode()


def signed_headers(secrets: list[bytes], message_id: str, body: bytes, now_s: float | None = None
                   ) -> dict[str, str]:
    """The scheme's headers, signed with each secret (the newest first; the scheme's receivers take any)."""
    timestamp = str(int(time.time() if now_s is None else now_s))
    signed = f"{message_id}.{timestamp}.".encode() + body
    signatures = " ".join("v1," + base64.b64encode(hmac.new(s, signed, hashlib.sha256).digest()).decode()
                          for s in secrets)
    return {"webhook-id": message_id, "webhook-timestamp": timestamp, "webhook-signature": signatures,
            "content-type": "application/json"}


class WebhookSecrets:
    """The tenants' secrets, derived from the master secret and each tenant's generation."""

    def __init__(self, engine: Engine, master: bytes | None):
        self.engine = engine
        self.master = master

    @property
    def enabled(self) -> bool:
        return bool(self.master)

    def generation(self, tenant_id: str) -> tuple[int, int | None]:
        with self.engine.connect() as conn:
            row = conn.execute(select(webhook_secrets.c.generation, webhook_secrets.c.rotated_at)
                               .where(webhook_secrets.c.tenant_id == tenant_id)).first()
        return (row[0], row[1]) if row else (0, None)

    def signing(self, tenant_id: str, grace_s: float) -> list[bytes]:
        """The tenant's secret, and for grace_s after a rotation the one before it too (so that receivers can
        move to the new one without dropping a delivery)."""
        assert self.master, "webhooks need the gateway's master secret"
        generation, rotated_at = self.generation(tenant_id)
        secrets = [tenant_secret(self.master, tenant_id, generation)]
        if rotated_at is not None and time.time() - rotated_at < grace_s:
            secrets.append(tenant_secret(self.master, tenant_id, generation - 1))
        return secrets

    def rotate(self, tenant_id: str) -> int:
        """The tenant's next generation (its secret changes at once); the new generation."""
        now = int(time.time())
        with self.engine.begin() as conn:
            done = conn.execute(update(webhook_secrets).where(webhook_secrets.c.tenant_id == tenant_id)
                                .values(generation=webhook_secrets.c.generation + 1, rotated_at=now))
            if done.rowcount == 0:
                conn.execute(insert(webhook_secrets).values(tenant_id=tenant_id, generation=1, rotated_at=now))
        return self.generation(tenant_id)[0]

    def shown(self, tenant_id: str) -> dict:
        """What the admin API answers: the secret in the scheme's form, its generation, when it was rotated."""
        generation, rotated_at = self.generation(tenant_id)
        return {"secret": secret_text(tenant_secret(self.master, tenant_id, generation)), "generation": generation,
                "rotated_at": rotated_at}


# the URL policy

def check_url(url: object, allowed: tuple[str, ...]) -> str:
    """url if the gateway may call it (module docstring); else InvalidRequest naming why. Resolves the host
    (blocking: call it in a thread)."""
    param = "webhook_url"
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise InvalidRequest(f"The webhook URL must be a URL of at most {MAX_URL_CHARS} characters.", param=param,
                             code="invalid_webhook_url")
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest("The webhook URL is not a valid URL.", param=param, code="invalid_webhook_url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("The webhook URL must be http:// or https:// with a host.", param=param,
                             code="invalid_webhook_url")
    if parts.username is not None or parts.password is not None:
        raise InvalidRequest("The webhook URL may not hold credentials; verify the signature instead.",
                             param=param, code="invalid_webhook_url")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InvalidRequest(f"The webhook host '{parts.hostname}' does not resolve.", param=param,
                             code="invalid_webhook_url") from None
    networks = [ipaddress.ip_network(n, strict=False) for n in allowed]
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not (address.is_global or any(address in n for n in networks)):
            raise InvalidRequest(f"The webhook host '{parts.hostname}' resolves to {address}, an address this "
                                 "gateway does not call (not public, not in its allowed networks).", param=param,
                                 code="webhook_url_refused")
    return url


def check_networks(networks: tuple[str, ...]) -> tuple[str, ...]:
    """The allowed networks as given, each a valid CIDR (a setting's error otherwise)."""
    for n in networks:
        try:
            ipaddress.ip_network(n, strict=False)
        except ValueError:
            raise ValueError(f"webhook allowed network {n!r} is not an address or CIDR network") from None
    return networks


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """The wait after the attempt-th failed delivery: base_s, 2 base_s, 4 base_s, ... at most max_s."""
    return min(base_s * 2 ** (attempt - 1), max_s)
