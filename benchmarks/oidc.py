"""What an identity provider's access token costs the gateway against one of its API keys.

The provider is real: oidc-provider on loopback (tests/oidc, `npm ci` there; RS256 tokens for the API's audience,
from the client-credentials grant). Two measures:

    in process   one token's check with the provider's keys warm (signature, issuer, audience, expiry: joserfc),
                 the same token again (kept checked until it expires), and a cached API key
                 (KeyCache.authenticate), each timed over --calls calls
    served       `inferd serve` (SmolLM2, with `oidc:` in its --gateway-config) answering a request it refuses
                 itself (an invalid chat body: 400 after authentication, the body and the plan lane), one kept-alive
                 client, the key and the token in turn, --rounds rounds of --requests each: latency at the
                 client and the gateway's CPU time per request

    PYTHONPATH=. .venv/bin/python benchmarks/oidc.py --out benchmarks/results/oidc-amx.json [--busy]
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.embeddings import ROOT, started_server, stopped, text_server_command
from benchmarks.machine import describe
from benchmarks.overload import quantile
from benchmarks.tls import cpu_s
from tests.oidc.idp import API, IdentityProvider, app_token, signing_key

KEY = "sk-bench-oidc-key"
BODY = {"model": "SmolLM2-135M-Instruct", "messages": "?"}


def in_process(issuer_url: str, token: str, folder: Path, calls: int) -> dict:
    from inferd.gateway.auth import KeyCache
    from inferd.gateway.keys import imported_key
    from inferd.gateway.oidc import Issuer, OIDCConfig, TokenKeys
    from inferd.gateway.store import Store

    async def main() -> dict:
        store = Store(f"sqlite:///{folder / 'in-process.db'}")
        store.migrate()
        store.create_tenant("team-a")
        store.create_key("team-a", new_key=imported_key(KEY))
        issuer = Issuer(issuer_url)
        await issuer.start()
        keys = KeyCache(store, 60.0)
        keys.tokens = TokenKeys(issuer, OIDCConfig(issuer_url, audience=API), store)
        bearer_key, bearer_token = f"Bearer {KEY}", f"Bearer {token}"
        await keys.authenticate(bearer_key)
        await keys.authenticate(bearer_token)
        timed = {"token_checked_us": lambda: issuer.check_cached_keys(token, API),
                 "token_again_us": lambda: keys.tokens.cached(token)}
        out = {}
        for name, call in timed.items():
            started = time.perf_counter()
            for _ in range(calls):
                call()
            out[name] = round((time.perf_counter() - started) / calls * 1e6, 2)
        for name, bearer in (("key_authenticate_us", bearer_key), ("token_authenticate_us", bearer_token)):
            started = time.perf_counter()
            for _ in range(calls):
                await keys.authenticate(bearer)
            out[name] = round((time.perf_counter() - started) / calls * 1e6, 2)
        await issuer.close()
        store.close()
        return out
    return asyncio.run(main())


def served(url: str, pid: int, bearer: str, n: int) -> dict:
    times = []
    with httpx.Client(base_url=url, timeout=30, headers={"authorization": f"Bearer {bearer}"}) as client:
        for _ in range(20):
            client.post("/v1/chat/completions", json=BODY)
        cpu = cpu_s(pid)
        for _ in range(n):
            started = time.perf_counter()
            r = client.post("/v1/chat/completions", json=BODY)
            times.append(time.perf_counter() - started)
            assert r.status_code == 400, r.text
        cpu = cpu_s(pid) - cpu
    return {"p50_ms": quantile(times, 0.5), "p99_ms": quantile(times, 0.99),
            "gateway_cpu_ms_per_request": round(cpu / n * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8977)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--busy", action="store_true", help="a CPU-bound Python process beside the server throughout")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="inferd-oidc-"))
    provider = IdentityProvider(folder, args.port + 1, args.port)
    provider.start(signing_key("bench"))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        token = app_token(provider.issuer, "app-a")
        local = in_process(provider.issuer, token, folder, args.calls)
        print("in process", json.dumps(local), flush=True)
        (folder / "gateway.yaml").write_text(f"oidc: {{issuer: {provider.issuer}, audience: {API}}}\n")
        command = text_server_command(folder, args.port, KEY, "--gateway-config", str(folder / "gateway.yaml"))
        subprocess.run([sys.executable, "-m", "inferd.cli", "tenants", "create", "team-a", "--db",
                        f"sqlite:///{folder / 'inferd.db'}"], check=True, capture_output=True, cwd=ROOT)
        url = f"http://127.0.0.1:{args.port}"
        proc = started_server(command, f"{url}/ready", {"PYTHONPATH": str(ROOT)}, "inferd-oidc")
        rounds: dict[str, list[dict]] = {"key": [], "token": []}
        try:
            for _ in range(args.rounds):
                for name, bearer in (("key", KEY), ("token", token)):
                    rounds[name].append(served(url, proc.pid, bearer, args.requests))
                    print(name, json.dumps(rounds[name][-1]), flush=True)
        finally:
            stopped(proc)
    finally:
        provider.stop()
        if busy is not None:
            busy.kill()
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    ratios = {k: round(medians["token"][k] / medians["key"][k], 3) for k in medians["key"]}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"load_average_before": os.getloadavg(),
                                       "shared": "a busy Python loop beside" if args.busy else "nothing else running"},
              "settings": vars(args) | {"out": args.out.name if args.out else None},
              "in_process": local, "served_rounds": rounds, "served_medians": medians, "token_over_key": ratios}
    print(json.dumps({"in_process": local, "served_medians": medians, "token_over_key": ratios}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
