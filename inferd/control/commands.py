"""`inferd gateway|keys|tenants|usage|console|rollout`: the gateway and its state, from the command line."""
import argparse
import csv
import getpass
import json
import os
import sys
import time
from datetime import datetime, timezone

import httpx

from inferd.console import users
from inferd.gateway.policy import BUDGET_PERIODS, PRIORITY_CLASSES, PolicyError
from inferd.gateway.store import Store, StoreError, default_db_url
from inferd.router.router import POLICIES

LIMIT_FLAGS = {"rpm": "requests per minute", "tpm": "tokens per minute (input + output)",
               "max_concurrency": "concurrent requests", "max_input_tokens": "input tokens per request",
               "max_output_tokens": "output tokens per request",
               "max_sessions": "robot policy sessions open at once"}


class CommandError(Exception):
    """What a command cannot do as asked (a bad argument value, a tenant that is not there): `inferd` prints
    `inferd COMMAND: error: MESSAGE` on one line of stderr and exits with 2, argparse's code; never a traceback."""


# parsers

def add_db_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=os.environ.get("INFERD_DB_URL") or default_db_url(),
                   help="SQLAlchemy URL of the store: sqlite:///file.db (default ~/.inferd/inferd.db) or "
                        "postgresql+psycopg://... ($INFERD_DB_URL)")


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    p.add_argument("--redis-url", default=os.environ.get("INFERD_REDIS_URL"),
                   help="share rate limits and concurrency between gateways ($INFERD_REDIS_URL)")
    p.add_argument("--admin-key", default=os.environ.get("INFERD_ADMIN_KEY"),
                   help="enables /admin/* for 'Authorization: Bearer KEY' and signing in to /console "
                        "($INFERD_ADMIN_KEY)")
    p.add_argument("--console-viewer-key", default=os.environ.get("INFERD_CONSOLE_VIEWER_KEY"),
                   help="signs in to /console read-only ($INFERD_CONSOLE_VIEWER_KEY)")
    p.add_argument("--gateway-config", default=None, help="YAML with prices per model and queue bounds")
    p.add_argument("--max-inflight", type=int, default=None, help="requests running at once per deployment "
                   "(default: replicas x --max-num-seqs, or 64)")
    p.add_argument("--max-queue-len", type=int, default=None, help="waiting requests per deployment (default 256)")
    p.add_argument("--max-queued-tokens", type=int, default=None, help="reserved tokens waiting per deployment")
    p.add_argument("--usage-journal", "--spill-path", dest="usage_journal", default=None,
                   help="usage records are appended here before the answer leaves, until the store has them "
                   "(one per gateway; default ~/.inferd/usage.journal)")
    p.add_argument("--files-dir", default=None, help="uploaded files and batch outputs, one folder per tenant "
                   "(default ~/.inferd/files)")
    p.add_argument("--batch-price-multiplier", type=float, default=0.5,
                   help="a batch line costs this share of the model's price (default 0.5)")
    p.add_argument("--tenant-batch-queued-tokens", type=int, default=20_000_000,
                   help="reserved tokens of one tenant's batch lines and async jobs not yet run; a batch or "
                   "job past it is refused: token_limit_exceeded (default 20,000,000)")
    p.add_argument("--lease-s", type=float, default=10.0, help="a batch line or async job whose gateway stopped "
                   "renewing its lease is taken over by another after this (default 10 s)")
    p.add_argument("--webhook-secret-file", default=None, help="the master secret async jobs' webhooks are signed "
                   "from (each tenant's derived from it; the same file on every gateway of a store); or "
                   "$INFERD_WEBHOOK_SECRET. Without it no webhooks are sent")
    p.add_argument("--webhook-allow-network", action="append", default=[], metavar="CIDR",
                   help="a private network webhooks may call, e.g. 10.0.0.0/8 (repeatable; default: public "
                   "addresses only)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM, its chain after "
                   "it); reloaded on SIGHUP or when the file changes (or tls: certfile in --gateway-config)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM), if not in its file")
    p.add_argument("--response-cache-ttl-s", type=float, default=0.0,
                   help="keep the text model's answers to deterministic requests (temperature 0 or a seed) this "
                   "long and answer the same request from them (default 0: off; per deployment in a spec)")
    p.add_argument("--response-cache-mib", type=float, default=64.0,
                   help="the response cache's bound in MiB (default 64)")
    p.add_argument("--router", choices=POLICIES, default="prefix",
                   help="replica choice: prefix-cache affinity against load (default), least_loaded, round_robin")
    p.add_argument("--router-affinity-weight", type=float, default=1.0)
    p.add_argument("--router-load-weight", type=float, default=1.0)
    p.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                   help="export traces over OTLP/HTTP to this base URL (default: off)")
    p.add_argument("--log-format", choices=["json", "text"], default="json")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    for name, what in LIMIT_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"{what} (0 removes the limit)")


def _add_tenant_flags(p: argparse.ArgumentParser) -> None:
    _add_limit_flags(p)
    p.add_argument("--model", default=None, help="apply the limit flags to this model only")
    p.add_argument("--budget-usd", type=float, default=None)
    p.add_argument("--budget-period", choices=BUDGET_PERIODS, default=None)
    p.add_argument("--weight", type=float, default=None, help="fair-share weight between tenants (default 1)")
    p.add_argument("--priority-class", choices=PRIORITY_CLASSES, default=None)
    p.add_argument("--deadline-ms", type=int, default=None, help="default deadline of the tenant's requests")
    p.add_argument("--queue-share", type=float, default=None, help="most of a queue one tenant may hold (0-1]")
    p.add_argument("--models", default=None, help="comma-separated models the tenant may use (default: all)")
    p.add_argument("--batch-queued-tokens", type=int, default=None, help="reserved tokens of the tenant's batch "
                   "lines and async jobs not yet run (default: the gateway's --tenant-batch-queued-tokens)")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys").add_subparsers(dest="action",
                                                                                                required=True)
    create = keys.add_parser("create", help="create a key (shown once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--models", default=None, help="comma-separated models this key may use")
    create.add_argument("--priority-class", choices=PRIORITY_CLASSES, default=None)
    _add_limit_flags(create)
    listing = keys.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant", default=None)
    revoke = keys.add_parser("revoke", help="revoke a key by id (key_...)")
    revoke.add_argument("key_id")
    tenants = commands.add_parser("tenants", help="create, update and list tenants").add_subparsers(
        dest="action", required=True)
    tc = tenants.add_parser("create")
    tc.add_argument("name")
    _add_tenant_flags(tc)
    tu = tenants.add_parser("update")
    tu.add_argument("name")
    _add_tenant_flags(tu)
    tenants.add_parser("list")
    ws = tenants.add_parser("webhook-secret", help="the tenant's webhook signing secret (derived from the "
                            "gateway's master secret, never stored); --rotate moves it to a new one")
    ws.add_argument("name")
    ws.add_argument("--rotate", action="store_true")
    ws.add_argument("--webhook-secret-file", default=None, help="the gateways' master secret "
                    "($INFERD_WEBHOOK_SECRET)")
    usage = commands.add_parser("usage", help="usage and cost per tenant and model for a period")
    usage.add_argument("--since", default=None, help="ISO date/time (UTC) or unix seconds (default: 30 days ago)")
    usage.add_argument("--until", default=None, help="ISO date/time (UTC) or unix seconds (default: now)")
    usage.add_argument("--tenant", default=None)
    usage.add_argument("--reconcile", metavar="GATEWAY_URL", default=None,
                       help="compare a running gateway's counters with its records (needs --admin-key)")
    usage.add_argument("--admin-key", default=os.environ.get("INFERD_ADMIN_KEY"))
    console = commands.add_parser("console", help="the operator console's users").add_subparsers(
        dest="what", required=True)
    user = console.add_parser("user", help="add, list, remove console users, set their password or role")
    user_actions = user.add_subparsers(dest="action", required=True)
    ua = user_actions.add_parser("add", help="a user who signs in to /console by name and password")
    up = user_actions.add_parser("passwd", help="a new password (and/or --role); the user's sessions end")
    for p in (ua, up):
        p.add_argument("name")
        p.add_argument("--role", choices=users.ROLES, default="viewer" if p is ua else None)
        p.add_argument("--password-stdin", action="store_true",
                       help="read the password from the first line of stdin (default: prompt for it); never "
                            "a flag, which would land in the shell's history")
    up.add_argument("--keep-password", action="store_true", help="change only --role")
    ur = user_actions.add_parser("remove", help="the user can no longer sign in; their sessions end")
    ur.add_argument("name")
    for p in (create, listing, revoke, tc, tu, tenants.choices["list"], ws, usage, ua, up, ur,
              user_actions.add_parser("list", help="names, roles, when created and changed")):
        add_db_flag(p)
        p.add_argument("--format", choices=["table", "csv", "json"], default="table")


def add_rollout_parser(commands: argparse._SubParsersAction) -> None:
    rollout = commands.add_parser("rollout", help="canary rollouts on a running gateway (its admin API)")
    actions = rollout.add_subparsers(dest="action", required=True)
    for action, what in (("start", "route the canary its share of the name's traffic and start judging it"),
                         ("status", "state, weight, the per-version comparison and the decision"),
                         ("promote", "make the canary the stable version now (the old one drains and stops)"),
                         ("rollback", "send no more traffic to the canary and stop it (stable is untouched)")):
        p = actions.add_parser(action, help=what)
        p.add_argument("name", nargs="?" if action == "status" else None, help="the deployment name")
        p.add_argument("--url", default=os.environ.get("INFERD_URL", "http://127.0.0.1:8000"),
                       help="the gateway's base URL ($INFERD_URL)")
        p.add_argument("--admin-key", default=os.environ.get("INFERD_ADMIN_KEY"))
        p.add_argument("--format", choices=["table", "json"], default="table")
        if action == "start":
            p.add_argument("--weight", type=float, default=None, help="the canary's share (default: the spec's)")


# commands

def rollout(args: argparse.Namespace) -> int:
    base = f"{args.url.rstrip('/')}/admin/rollouts"
    headers = {"authorization": f"Bearer {args.admin_key or ''}"}
    try:
        if args.action == "status":
            r = httpx.get(f"{base}/{args.name}" if args.name else base, headers=headers, timeout=10)
        else:
            body = {"weight": args.weight} if args.action == "start" and args.weight is not None else None
            r = httpx.post(f"{base}/{args.name}/{args.action}", json=body, headers=headers, timeout=60)
    except httpx.HTTPError as exc:
        print(f"inferd rollout: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if r.status_code >= 400:
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        print(f"inferd rollout: error: {error.get('message') or r.text} (HTTP {r.status_code})", file=sys.stderr)
        return 1
    rows = r.json()["data"] if args.action == "status" and not args.name else [r.json()]
    if args.format == "json":
        print(json.dumps(rows if len(rows) != 1 else rows[0], indent=2))
    else:
        for row in rows:
            _rollout_table(row)
    return 0


def _rollout_table(row: dict) -> None:
    mode = "auto" if row["auto"] else "report only"
    print(f"{row['name']}: {row['state']}, canary {row['canary_version']} at {row['weight']:.0%} of traffic "
          f"({mode}; window {row['window_s']:g} s, min {row['min_requests']} canary requests)")
    _table([{"version": v, "role": s["role"], "requests": s["requests"], "errors": s["errors"],
             "error_rate": s["error_rate"], "ttft_p95_s": s["ttft_p95_s"], "tpot_p95_s": s["tpot_p95_s"],
             "cost_per_request_usd": s["cost_per_request_usd"], "probe_score": s["probe_score"]}
            for v, s in row["versions"].items()])
    d = row["decision"]
    by = f" ({d['by']})" if d["by"] else ""
    print(f"decision: {d['action']}{by}: {'; '.join(d['reasons'])}\n")


def run(args: argparse.Namespace) -> int:
    store = None
    try:
        store = Store(args.db)
        store.migrate()
        return {"keys": _keys, "tenants": _tenants, "usage": _usage, "console": _console}[args.command](store, args)
    except (StoreError, PolicyError, ValueError, OSError, httpx.HTTPError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        if store is not None:
            store.close()


def _keys(store: Store, args: argparse.Namespace) -> int:
    if args.action == "create":
        policy, new = store.create_key(args.tenant, args.name, _limits(args), _models(args.models),
                                       args.priority_class, actor=_actor())
        row = {"id": policy.id, "key": new.key, "tenant": args.tenant, "name": args.name}
        if args.format == "json":
            print(json.dumps(row))
        else:
            print(f"{new.key}\n(key {policy.id} for tenant {args.tenant}: shown once, store it now)")
        return 0
    if args.action == "list":
        _print([_key_row(k) for k in store.keys(args.tenant)], args.format)
        return 0
    if not store.revoke_key(args.key_id, actor=_actor()):
        print(f"inferd keys: error: no live key {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id}")
    return 0


def _tenants(store: Store, args: argparse.Namespace) -> int:
    if args.action == "webhook-secret":
        return _webhook_secret(store, args)
    if args.action == "list":
        _print([_tenant_row(t) for t in store.tenants()], args.format)
        return 0
    limits, settings = _limits(args), _tenant_settings(args)
    model_limits = {args.model: limits} if args.model else None
    if args.model:
        limits = None
    if args.action == "create":
        t = store.create_tenant(args.name, limits, model_limits, actor=_actor(), **settings)
    else:
        t = store.update_tenant(args.name, limits, model_limits, actor=_actor(), **settings)
    _print([_tenant_row(t)], args.format)
    return 0


def _webhook_secret(store: Store, args: argparse.Namespace) -> int:
    from inferd.control.gateway_setup import webhook_master_secret
    from inferd.gateway.webhooks import WebhookSecrets
    secrets = WebhookSecrets(store.engine, webhook_master_secret(args.webhook_secret_file))
    if not secrets.enabled:
        raise StoreError("no webhook master secret: pass --webhook-secret-file or set $INFERD_WEBHOOK_SECRET")
    tenant = store.tenant(args.name)
    if args.rotate:
        generation = secrets.rotate(tenant.id)
        store.record_change(_actor(), "webhook.rotate", args.name, {"generation": generation})
    _print([{"tenant": args.name} | secrets.shown(tenant.id)], args.format)
    return 0


def _console(store: Store, args: argparse.Namespace) -> int:
    if args.action == "list":
        _print([{"name": u["name"], "role": u["role"], "created": _iso(u["created_unix_s"]),
                 "updated": _iso(u["updated_unix_s"])} for u in store.console_users()], args.format)
        return 0
    if args.action == "remove":
        if not store.remove_console_user(args.name, actor=_actor()):
            print(f"inferd console: error: no console user {args.name}", file=sys.stderr)
            return 1
        print(f"removed {args.name}")
        return 0
    users.check_user(args.name, args.role)
    keep = args.action == "passwd" and args.keep_password
    if keep and args.role is None:
        raise ValueError("--keep-password changes only the role: give --role")
    hashed = None if keep else users.hash_password(_password(args.password_stdin))
    if args.action == "add":
        store.create_console_user(args.name, args.role, hashed, actor=_actor())
    elif not store.update_console_user(args.name, _actor(), hashed, args.role):
        print(f"inferd console: error: no console user {args.name}", file=sys.stderr)
        return 1
    print(f"{'added' if args.action == 'add' else 'changed'} {args.name}")
    return 0


def _password(from_stdin: bool) -> str:
    """The new password: stdin's first line, or typed twice at a prompt that does not echo."""
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    first = getpass.getpass("Password: ")
    if getpass.getpass("Again: ") != first:
        raise ValueError("the two passwords differ")
    return first


def _usage(store: Store, args: argparse.Namespace) -> int:
    if args.reconcile:
        return _reconcile(store, args)
    until = _when(args.until) if args.until else time.time()
    since = _when(args.since) if args.since else until - 30 * 86400
    rows = store.usage_summary(since, until, args.tenant)
    _print(rows, args.format)
    return 0


def _reconcile(store: Store, args: argparse.Namespace) -> int:
    """The gateway's own counters against the records the store holds for that gateway."""
    r = httpx.get(f"{args.reconcile.rstrip('/')}/admin/counters",
                  headers={"authorization": f"Bearer {args.admin_key}"}, timeout=10)
    r.raise_for_status()
    counters = r.json()
    rows = store.usage_summary(0, time.time() + 1, gateway_id=counters["gateway_id"])
    stored = {k: sum(row[k] for row in rows) for k in ("requests", "prompt_tokens", "cached_tokens",
                                                        "completion_tokens", "cost_usd")}
    pairs = [("records", counters["records"], stored["requests"])] + [
        (k, counters[k], stored[k]) for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd")]
    _print([{"what": k, "gateway": g, "store": s, "match": abs(g - s) < 1e-9} for k, g, s in pairs], args.format)
    ok = all(abs(g - s) < 1e-9 for _, g, s in pairs)
    if not ok:
        print(f"mismatch ({counters['pending']} records still pending in the gateway)", file=sys.stderr)
    return 0 if ok else 1


# helpers

def _actor() -> str:
    """Who the audit log names for a change made from the command line."""
    return f"cli:{getpass.getuser()}"


def _limits(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in LIMIT_FLAGS if getattr(args, k) is not None}


def _models(raw: str | None) -> list[str] | None:
    return [m.strip() for m in raw.split(",") if m.strip()] if raw else None


def _tenant_settings(args: argparse.Namespace) -> dict:
    return {"budget_usd": args.budget_usd, "budget_period": args.budget_period, "weight": args.weight,
            "priority_class": args.priority_class, "default_deadline_ms": args.deadline_ms,
            "queue_share": args.queue_share, "allowed_models": _models(args.models),
            "batch_queued_tokens": args.batch_queued_tokens}


def _when(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        dt = datetime.fromisoformat(raw)
        return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def _key_row(k: dict) -> dict:
    return {"id": k["id"], "tenant": k["tenant"], "name": k["name"], "limits": json.dumps(k["limits"]),
            "models": ",".join(k["allowed_models"] or []) or "*", "class": k["priority_class"] or "",
            "created": _iso(k["created_unix_s"]), "revoked": _iso(k["revoked_unix_s"])}


def _tenant_row(t) -> dict:
    return {"id": t.id, "name": t.name, "limits": json.dumps(t.limits.to_dict()),
            "model_limits": json.dumps({m: v.to_dict() for m, v in t.model_limits.items()}),
            "budget_usd": t.budget_usd, "period": t.budget_period, "weight": t.weight, "class": t.priority_class,
            "deadline_ms": t.default_deadline_ms, "models": ",".join(t.allowed_models or []) or "*"}


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else ""


def _print(rows: list[dict], fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(rows, indent=2))
    elif fmt == "csv":
        if rows:
            w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        _table(rows)


def _table(rows: list[dict]) -> None:
    if not rows:
        print("(none)")
        return
    cells = [[_cell(v) for v in r.values()] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(rows[0])]
    print("  ".join(h.ljust(w) for h, w in zip(rows[0], widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6f}".rstrip("0").rstrip(".") if v else "0"
    return "" if v is None else str(v)
