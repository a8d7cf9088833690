"""What HTTPS costs the gateway: `inferd serve` with --ssl-certfile against the same server in plain HTTP, in turn.

The request is one the gateway answers itself (a chat request whose body names the model but is invalid: 400
after the key, the body, the deployment and the plan lane), so that the model's time does not hide the
gateway's. One client, one request at a time, --requests each: on one kept-alive connection, then on a new
connection each (a TLS handshake each). Latency at the client; the gateway process's CPU time (user + system,
from /proc) per request. The certificate is a P-256 one made with openssl.

    PYTHONPATH=. .venv/bin/python benchmarks/tls.py --out benchmarks/results/tls.json
    PYTHONPATH=. .venv/bin/python benchmarks/tls.py --busy --out ...  # beside a busy process
"""
import argparse
import json
import os
import ssl
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

KEY = "sk-bench-tls-key"
BODY = {"model": "SmolLM2-135M-Instruct", "messages": "?"}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def measure(url: str, verify, pid: int, n: int, keep_alive: bool) -> dict:
    headers = {"authorization": f"Bearer {KEY}"}
    times = []
    client = httpx.Client(base_url=url, verify=verify, timeout=30, headers=headers) if keep_alive else None
    for _ in range(20):  # warm-up
        httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=headers, verify=verify)
    cpu = cpu_s(pid)
    for _ in range(n):
        started = time.perf_counter()
        if client is None:
            with httpx.Client(base_url=url, verify=verify, timeout=30, headers=headers) as one:
                r = one.post("/v1/chat/completions", json=BODY)
        else:
            r = client.post("/v1/chat/completions", json=BODY)
        times.append(time.perf_counter() - started)
        assert r.status_code == 400, r.text
    cpu = cpu_s(pid) - cpu
    if client is not None:
        client.close()
    return {"p50_ms": quantile(times, 0.5), "p99_ms": quantile(times, 0.99), "gateway_cpu_ms_per_request":
            round(cpu / n * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--port", type=int, default=8975)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--busy", action="store_true", help="a CPU-bound Python process beside the servers throughout")
    args = p.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    folder = Path(tempfile.mkdtemp(prefix="inferd-tls-"))
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    results = {}
    for name, tls in (("http", False), ("https", True)):
        (folder / name).mkdir()
        command = text_server_command(folder / name, args.port, KEY,
                                      *(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)] if tls else []))
        url = f"{name}://127.0.0.1:{args.port}"
        verify = ssl.create_default_context(cafile=str(cert)) if tls else False  # no CA bundle loaded a client
        proc = started_server(command, f"{url}/ready", {"PYTHONPATH": str(ROOT)}, f"inferd-{name}", verify=verify)
        try:
            results[name] = {"kept_alive": measure(url, verify, proc.pid, args.requests, True),
                             "new_connection_each": measure(url, verify, proc.pid, args.requests // 4, False)}
        finally:
            stopped(proc)
        print(name, json.dumps(results[name]), flush=True)
    if busy is not None:
        busy.kill()
    ratios = {mode: {k: round(results["https"][mode][k] / results["http"][mode][k], 2)
                     for k in results["http"][mode]} for mode in results["http"]}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"load_average_before": os.getloadavg(), "shared": "a busy Python loop beside" if args.busy else
                                       "nothing else running"},
              "settings": vars(args) | {"out": args.out.name if args.out else None},
              "results": results, "https_over_http": ratios}
    print(json.dumps(ratios, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
