"""The gateway's settings: one typed object, from CLI flags and an optional YAML file (prices, queues)."""
import os
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from inferd.gateway.admission import QueueConfig
from inferd.gateway.oidc import OIDCConfig
from inferd.gateway.policy import PolicyError
from inferd.gateway.response_cache import ResponseCacheConfig
from inferd.router.router import RouterConfig


@dataclass(slots=True, frozen=True)
class ModelPrice:
    """USD per million tokens (a classical model's rows, a policy's observations count as input tokens), and
    for robot policy sessions per hour connected."""
    input_usd_per_mtok: float = 0.0
    cached_input_usd_per_mtok: float = 0.0
    output_usd_per_mtok: float = 0.0
    session_usd_per_hour: float = 0.0

    def cost_usd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, session_s: float = 0.0
                 ) -> float:
        fresh = prompt_tokens - cached_tokens
        return (fresh * self.input_usd_per_mtok + cached_tokens * self.cached_input_usd_per_mtok
                + completion_tokens * self.output_usd_per_mtok) / 1e6 + session_s / 3600 * self.session_usd_per_hour

    def scaled(self, multiplier: float) -> "ModelPrice":
        return ModelPrice(self.input_usd_per_mtok * multiplier, self.cached_input_usd_per_mtok * multiplier,
                          self.output_usd_per_mtok * multiplier, self.session_usd_per_hour * multiplier)


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str = ""
    redis_url: str | None = None
    admin_key: str | None = None  # guards /admin/*; never logged
    console_viewer_key: str | None = None  # signs in to /console read-only; never logged
    gateway_id: str = field(default_factory=lambda: f"gw_{uuid.uuid4().hex[:12]}")
    prices: dict[str, ModelPrice] = field(default_factory=dict)
    queue: QueueConfig = field(default_factory=QueueConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    ssl_certfile: Path | None = None  # HTTPS on the public port (control/tls.py reloads it)
    ssl_keyfile: Path | None = None
    oidc: OIDCConfig | None = None  # tokens and sign-in from an identity provider (gateway/oidc.py)
    response_cache: ResponseCacheConfig | None = None  # the text deployment's made from flags (a spec's: its own)
    key_cache_ttl_s: float = 0.5  # a revoked key stops working within this (+ one store read)
    usage_journal: Path = Path.home() / ".inferd" / "usage.journal"  # one per gateway process (usage.py)
    max_body_bytes: int = 16 * 2**20
    tenant_label_limit: int = 100  # tenants named in metrics; the rest are counted as "other"
    otlp_endpoint: str | None = None
    # files and batches (files.py, batches.py, batch_runner.py)
    files_dir: Path = Path.home() / ".inferd" / "files"  # the local file storage: one folder per tenant
    max_file_bytes: int = 200 * 2**20  # one uploaded file
    tenant_files_max_bytes: int = 2 * 2**30  # all of a tenant's files together
    batch_price_multiplier: float = 0.5  # a batch line costs this share of the model's price
    batch_max_lines: int = 50_000
    tenant_batch_queued_tokens: int = 20_000_000  # reserved tokens of a tenant's unfinished batch lines and jobs
    lease_s: float = 10.0  # a batch line or async job is another gateway's to take this long after its own stops
    # async jobs and their webhooks (async_jobs.py, async_runner.py, webhooks.py)
    async_window_s: int = 24 * 3600  # a job not answered by then fails as job_expired
    async_max_running: int = 64  # jobs at once on this gateway (each still waits for admission)
    webhook_master_secret: bytes | None = field(default=None, repr=False)  # tenants' secrets derive from it
    webhook_allow_networks: tuple[str, ...] = ()  # private networks webhooks may call (CIDR), e.g. 10.0.0.0/8
    webhook_timeout_s: float = 10.0  # one delivery attempt
    webhook_max_attempts: int = 8
    webhook_backoff_s: float = 2.0  # after the first failed attempt; doubling
    webhook_backoff_max_s: float = 600.0
    webhook_rotation_grace_s: float = 24 * 3600  # after a rotation, deliveries are signed with the old secret too

    def price(self, model: str) -> ModelPrice:
        return self.prices.get(model) or self.prices.get("*") or ModelPrice()


def load_settings_file(path: str | Path) -> dict[str, Any]:
    """Read prices, queue, TLS and OIDC settings from YAML; unknown fields are errors that name them."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {exc}") from None
    _known(raw, {"prices", "queue", "tls", "oidc"}, str(path))
    prices = {model: ModelPrice(**_known(p or {}, _names(ModelPrice), f"prices.{model}"))
              for model, p in (raw.get("prices") or {}).items()}
    queue = QueueConfig(**_known(raw.get("queue") or {}, _names(QueueConfig), "queue"))
    tls = _known(raw.get("tls") or {}, {"certfile", "keyfile"}, "tls")
    return {"prices": prices, "queue": queue, "tls": tls, "oidc": oidc_config(raw.get("oidc"))}


OIDC_FIELDS = {"issuer", "audience", "tenant_claim", "client_id", "client_secret_file", "groups_claim", "roles",
               "scopes", "redirect_uri", "leeway_s"}


def oidc_config(raw: dict | None) -> OIDCConfig | None:
    """The `oidc:` section; the client's secret from client_secret_file, else $INFERD_OIDC_CLIENT_SECRET (never
    from the YAML itself)."""
    if raw is None:
        return None
    raw = dict(_known(raw, OIDC_FIELDS, "oidc"))
    if "issuer" not in raw:
        raise PolicyError("oidc.issuer: required (the identity provider's issuer URL)")
    secret_file = raw.pop("client_secret_file", None)
    try:
        secret = Path(secret_file).read_text().strip() if secret_file else os.environ.get("INFERD_OIDC_CLIENT_SECRET")
    except OSError as exc:
        raise PolicyError(f"oidc.client_secret_file: {exc.strerror}: {secret_file}") from None
    roles = raw.pop("roles", None) or {}
    if not isinstance(roles, dict):
        raise PolicyError("oidc.roles: a mapping of a group to admin, viewer or member")
    scopes = tuple(raw.pop("scopes", None) or ("openid", "profile", "groups"))
    try:
        return OIDCConfig(**raw, client_secret=secret or None, roles={str(g): r for g, r in roles.items()},
                          scopes=scopes)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _known(raw: dict, allowed: set[str], where: str) -> dict:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: expected a mapping")
    unknown = set(raw) - allowed
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(allowed))})")
    return raw
