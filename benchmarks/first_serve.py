"""`make serve` as a new user runs it: a clean clone of a revision, a fresh HOME, until /ready answers 200.
Reports the whole time, and the serve step's own start: its process start to ready (the install, with its pip
installs and, from #55's stage 2, the kernels' build, comes before it). With --pip-cache the clone's installs read
that pip cache (a warm cache, as on a machine that installed Python packages before).

    PYTHONPATH=. .venv/bin/python benchmarks/first_serve.py --revs HEAD,6c7d9f7 --pip-cache ~/.cache/pip \
        --out benchmarks/results/first-serve.json
"""
import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def first_serve(rev: str, pip_cache: str | None, port: int, timeout_s: float = 1200) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        clone, home = Path(tmp) / "clone", Path(tmp) / "home"
        home.mkdir()
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", rev], cwd=clone, check=True)
        env = os.environ | {"HOME": str(home)} | ({"PIP_CACHE_DIR": pip_cache} if pip_cache else {})
        env.pop("PYTHONPATH", None)
        log = (Path(tmp) / "serve.log").open("w")
        began = time.monotonic()
        proc = subprocess.Popen(["make", "serve", f"PORT={port}"], cwd=clone, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        serve_began = None
        try:
            while time.monotonic() - began < timeout_s:
                if serve_began is None and any("inferd serve" in " ".join(_cmdline(p)) for p in _children(proc.pid)):
                    serve_began = time.monotonic()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                        ready = time.monotonic()
                        return {"rev": subprocess.run(["git", "rev-parse", "--short", rev], cwd=clone, check=True,
                                                      capture_output=True, text=True).stdout.strip(),
                                "make_serve_to_ready_s": round(ready - began, 1),
                                "serve_start_to_ready_s": round(ready - serve_began, 1) if serve_began else None}
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"make serve exited {proc.returncode}")
                time.sleep(0.5)
            raise RuntimeError(f"not ready after {timeout_s} s")
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)


def _children(pid: int) -> list[int]:
    """Every descendant of pid (make, its shell, inferd serve)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--revs", default="HEAD", help="revisions, in turn")
    p.add_argument("--pip-cache", default=None)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs = []
    for rev in args.revs.split(","):
        runs.append(first_serve(rev, args.pip_cache, args.port))
        print(json.dumps(runs[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "warm_pip_cache": bool(args.pip_cache),
              "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
