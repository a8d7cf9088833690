"""Gateway overhead: inferd's gateway against the LiteLLM proxy, over a fast fake upstream, in one run.

Each target runs alone on one core (`taskset -c 1`); this load generator runs on
the other (core 0), and so does the fake upstream (benchmarks/fake_upstream.py)
when a gateway sits in front of it. Targets:

  direct   the fake upstream itself, on core 1: the baseline every "added" figure subtracts
  inferd   `inferd gateway` over the fake upstream; one tenant, TPM limit --tpm-limit, one key;
           the code of --inferd-rev (default HEAD), exported, so edits in the tree during the run don't count.
           inferd@REV runs commit REV (inferd@worktree: the tree as it is); several in one run
           (inferd@09248e8,inferd@HEAD) are each a target of its own, named inferd@<short commit>
  litellm  the LiteLLM proxy (litellm[proxy] in --litellm-venv, config benchmarks/litellm/),
           one uvicorn worker, one key with the same TPM limit

(a) Added latency: one keep-alive connection, one request at a time, after warm-up:
    end-to-end latency of non-streaming chat completions, and time to the first
    SSE `data:` line of streaming ones (stream_options.include_usage on).
(b) Maximum requests/s: closed loop, non-streaming, N connections each sending
    its next request when the last one ends, for --duration-s at each N.
Each measurement runs --repeats times, every target in turn within each repeat (all
targets stay up for the whole run), so drift in the machine's speed hits all alike;
the report quotes medians. The CPU time the
target's processes spend per request is reported beside req/s: it holds still when
other jobs on the machine take turns on core 1, where req/s and p99 do not.
The report gives each inferd target's ratios to LiteLLM and, for each pair of inferd
revisions, the later's over the earlier's (later: more commits in its history).

    PYTHONPATH=. .venv/bin/python benchmarks/gateway.py --nice -10 --out benchmarks/results/gateway
    PYTHONPATH=. .venv/bin/python benchmarks/gateway.py --nice -10 \
        --targets direct,inferd@09248e8,inferd@HEAD,litellm --out benchmarks/results/gateway   # before/after

On first use it creates benchmarks/.venvs/litellm (python3.11 -m venv, then pip install
'litellm[proxy]' opentelemetry-sdk); --litellm-venv names another. About 8 minutes with
the defaults, 2 more per extra inferd revision. --targets direct,litellm skips a target;
one that fails to start is reported as failed and the others still run.
"""
import argparse
import asyncio
import io
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fake-model"
TARGET_CPU, CLIENT_CPU = 1, 0
ALL_TARGETS = ("direct", "inferd", "litellm")
LITELLM_VENV, LITELLM_PACKAGES = "benchmarks/.venvs/litellm", ["litellm[proxy]", "opentelemetry-sdk"]


@dataclass(slots=True)
class Settings:
    targets: list[str]
    latency_requests: int = 500
    warmup_requests: int = 200
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    duration_s: float = 10.0
    repeats: int = 3
    tpm_limit: int = 10**9
    request_timeout_s: float = 30.0
    startup_timeout_s: float = 120.0
    client: str = "raw"
    litellm_venv: str = LITELLM_VENV  # relative to the repository root, or absolute
    max_tokens: int = 16
    nice: int = 0
    inferd_rev: str = "HEAD"  # of a bare `inferd` in --targets


class TargetFailed(Exception):
    pass


# ---- the request

def request_body(stream: bool, max_tokens: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to a friend."}],
            "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


def response_ok(status: int, body: bytes, stream: bool) -> bool:
    return status == 200 and (b"data: [DONE]" in body if stream else b'"choices"' in body)


@dataclass(slots=True)
class Sample:
    ok: bool
    status: int
    first_s: float  # to the first SSE data line (streaming) or the whole body
    total_s: float


# ---- load generator clients: raw asyncio HTTP/1.1 (default) or httpx, one keep-alive connection each

class RawConnection:
    """HTTP/1.1 over asyncio streams; Content-Length or chunked responses."""

    def __init__(self, base_url: str, key: str, max_tokens: int):
        host_port = base_url.split("://", 1)[1].split("/", 1)[0]
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.requests = {s: self._request_bytes(host_port, key, request_body(s, max_tokens)) for s in (False, True)}
        self.reader = self.writer = None

    @staticmethod
    def _request_bytes(host_port: str, key: str, body: bytes) -> bytes:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host_port}\r\ncontent-type: application/json\r\n"
                f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n")
        return head.encode() + body

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def post(self, stream: bool) -> Sample:
        if self.writer is None:
            await self.open()
        t0 = time.perf_counter()
        self.writer.write(self.requests[stream])
        status, first, body, close = await self._read_response()
        total = time.perf_counter()
        if close:
            await self.close()
        return Sample(response_ok(status, body, stream), status, (first or total) - t0, total - t0)

    async def _read_response(self) -> tuple[int, float | None, bytes, bool]:
        reader = self.reader
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed before the status line")
        status = int(line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = h.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"connection":
                close = value == b"close"
        if chunked:
            return status, *await self._read_chunked(), close
        if length is not None:
            return status, None, await reader.readexactly(length), close
        return status, None, await reader.read(), True

    async def _read_chunked(self) -> tuple[float | None, bytes]:
        reader, parts, first = self.reader, [], None
        while size := int((await reader.readline()).split(b";", 1)[0], 16):
            data = await reader.readexactly(size + 2)
            if first is None and b"data:" in data:
                first = time.perf_counter()
            parts.append(data[:-2])
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
        return first, b"".join(parts)


class HttpxConnection:
    """The same through httpx (to cross-check the raw client; slower per request)."""

    def __init__(self, base_url: str, key: str, max_tokens: int):
        import httpx
        self.client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=httpx.Limits(max_connections=1),
                                        headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
        self.bodies = {s: request_body(s, max_tokens) for s in (False, True)}

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.client.aclose()

    async def post(self, stream: bool) -> Sample:
        import httpx
        t0 = time.perf_counter()
        first, parts = None, []
        try:
            async with self.client.stream("POST", "/v1/chat/completions", content=self.bodies[stream]) as r:
                async for data in r.aiter_raw():
                    if first is None and b"data:" in data:
                        first = time.perf_counter()
                    parts.append(data)
        except httpx.HTTPError as e:
            raise ConnectionError(str(e)) from e
        total = time.perf_counter()
        return Sample(response_ok(r.status_code, b"".join(parts), stream), r.status_code, (first or total) - t0, total - t0)


def new_connection(settings: Settings, base_url: str, key: str):
    cls = RawConnection if settings.client == "raw" else HttpxConnection
    return cls(base_url, key, settings.max_tokens)


# ---- measurements

CLIENT_ERRORS = (OSError, EOFError, asyncio.TimeoutError, ValueError, IndexError)  # EOFError: IncompleteReadError

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]  # nearest rank


def summary_ms(values_s: list[float]) -> dict:
    ms = [v * 1e3 for v in values_s]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": statistics.fmean(ms), "n": len(ms)}


async def sequential(settings: Settings, base_url: str, key: str, stream: bool, n: int) -> tuple[list[Sample], int]:
    conn = new_connection(settings, base_url, key)
    samples, errors = [], 0
    try:
        for _ in range(n):
            try:
                async with asyncio.timeout(settings.request_timeout_s):
                    s = await conn.post(stream)
            except CLIENT_ERRORS:
                errors += 1
                await conn.close()
                continue
            if s.ok:
                samples.append(s)
            else:
                errors += 1
    finally:
        await conn.close()
    return samples, errors


async def latency_run(settings: Settings, base_url: str, key: str) -> dict:
    nonstream, e1 = await sequential(settings, base_url, key, False, settings.latency_requests)
    stream, e2 = await sequential(settings, base_url, key, True, settings.latency_requests)
    if not nonstream or not stream:
        raise TargetFailed(f"latency run: no successful request ({e1} + {e2} errors)")
    return {"nonstream_e2e_ms": summary_ms([s.total_s for s in nonstream]),
            "stream_ttfb_ms": summary_ms([s.first_s for s in stream]),
            "stream_e2e_ms": summary_ms([s.total_s for s in stream]),
            "errors": e1 + e2}


async def closed_loop(settings: Settings, base_url: str, key: str, concurrency: int, target_pgid: int) -> dict:
    conns = [new_connection(settings, base_url, key) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns), return_exceptions=True)  # a failed one retries in post()
    counts = {"ok": 0, "errors": 0, "status": {}}

    async def worker(conn, deadline: float) -> None:
        while time.perf_counter() < deadline:
            try:
                async with asyncio.timeout(settings.request_timeout_s):
                    s = await conn.post(False)
            except CLIENT_ERRORS:
                counts["errors"] += 1
                await conn.close()
                continue
            if s.ok:
                counts["ok"] += 1
            else:
                counts["errors"] += 1
                counts["status"][s.status] = counts["status"].get(s.status, 0) + 1

    cpu0, t0 = group_cpu_s(target_pgid), time.perf_counter()
    await asyncio.gather(*(worker(c, t0 + settings.duration_s) for c in conns))
    elapsed, cpu = time.perf_counter() - t0, group_cpu_s(target_pgid) - cpu0
    await asyncio.gather(*(c.close() for c in conns))
    return {"concurrency": concurrency, "rps": counts["ok"] / elapsed, "ok": counts["ok"],
            "errors": counts["errors"], "error_status": counts["status"], "elapsed_s": elapsed,
            "target_cpu_s": cpu, "target_cpu_ms_per_request": 1e3 * cpu / max(1, counts["ok"] + counts["errors"])}


def med(values: list[float]) -> float:
    return statistics.median(values)


@dataclass(slots=True)
class Target:
    name: str
    procs: "Processes"
    base_url: str = ""
    key: str = ""
    pgid: int = 0
    error: str = ""
    latency_runs: list = field(default_factory=list)
    throughput_runs: dict = field(default_factory=dict)

    def fail(self, error: str) -> None:
        print(f"  {self.name}: FAILED: {error}", flush=True)
        self.error = error

    def check_alive(self) -> bool:
        p = self.procs.procs[-1][1] if self.procs.procs else None
        if not self.error and (p is None or p.poll() is not None):
            self.fail(f"exited with {p.returncode if p else '?'}:\n{self.procs.log_tail(self.procs.procs[-1][0])}")
        return not self.error


def core_speed_us(cpu: int) -> float:
    """µs per sum(range(1000)) on core cpu: how fast the machine runs Python right now (it drifts)."""
    code = "import time; t=time.perf_counter(); [sum(range(1000)) for _ in range(5000)]; print(time.perf_counter()-t)"
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code], capture_output=True, text=True)
    return float(out.stdout) / 5000 * 1e6


async def warm_up(settings: Settings, t: Target) -> None:
    warm, errors = await sequential(settings, t.base_url, t.key, False, settings.warmup_requests)
    warm_s, errors_s = await sequential(settings, t.base_url, t.key, True, settings.warmup_requests // 4)
    if not warm or not warm_s:
        raise TargetFailed(f"warm-up: no successful request ({errors + errors_s} errors)")


async def measure_all(settings: Settings, targets: list[Target]) -> list[float]:
    """Every repeat measures every target in turn, so that drift in the machine's speed hits all alike."""
    speeds = []
    live = lambda: [t for t in targets if t.check_alive()]  # noqa: E731
    for t in live():
        try:
            await warm_up(settings, t)
        except TargetFailed as e:
            t.fail(str(e))
    for i in range(settings.repeats):
        speeds.append(core_speed_us(TARGET_CPU))
        for t in live():
            try:
                r = await latency_run(settings, t.base_url, t.key)
            except TargetFailed as e:
                t.fail(str(e))
                continue
            t.latency_runs.append(r)
            print(f"  run {i + 1} {t.name:16s} latency: non-stream p50 {r['nonstream_e2e_ms']['p50']:.3f} ms, "
                  f"stream TTFB p50 {r['stream_ttfb_ms']['p50']:.3f} ms, errors {r['errors']}", flush=True)
    for i in range(settings.repeats):
        speeds.append(core_speed_us(TARGET_CPU))
        for c in settings.concurrencies:
            for t in live():
                r = await closed_loop(settings, t.base_url, t.key, c, t.pgid)
                t.throughput_runs.setdefault(c, []).append(r)
                print(f"  run {i + 1} {t.name:16s} concurrency {c:3d}: {r['rps']:8.1f} req/s, errors {r['errors']}, "
                      f"target CPU {r['target_cpu_ms_per_request']:.3f} ms/request", flush=True)
    speeds.append(core_speed_us(TARGET_CPU))
    return speeds


def summarize(t: Target) -> dict:
    if t.error:
        return {"status": "failed", "error": t.error}
    latency = {metric: {stat: med([r[metric][stat] for r in t.latency_runs]) for stat in ("p50", "p99", "mean")}
               for metric in ("nonstream_e2e_ms", "stream_ttfb_ms", "stream_e2e_ms")}
    latency |= {"errors": sum(r["errors"] for r in t.latency_runs), "runs": t.latency_runs}
    levels = {c: {"rps_median": med([r["rps"] for r in runs]), "errors": sum(r["errors"] for r in runs),
                  "target_cpu_ms_per_request_median": med([r["target_cpu_ms_per_request"] for r in runs]),
                  "runs": runs} for c, runs in t.throughput_runs.items()}
    best = max(levels, key=lambda c: levels[c]["rps_median"])
    throughput = {"max_rps": levels[best]["rps_median"], "max_rps_concurrency": best,
                  "target_cpu_ms_per_request": levels[best]["target_cpu_ms_per_request_median"],
                  "errors": sum(v["errors"] for v in levels.values()), "by_concurrency": levels}
    return {"status": "ok", "latency": latency, "throughput": throughput}


# ---- processes

def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group pgid."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_priority(pid: int, nice: int) -> None:
    """Niceness of pid and, where the kernel groups processes by session (autogroup), of its session's group:
    with autogroup on, a process's own niceness counts only against its session, not against other jobs."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


class Processes:
    """Every process a target started, each in its own session, stopped in reverse order."""

    def __init__(self, logdir: Path, nice: int):
        self.logdir, self.nice = logdir, nice
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, cmd: list[str], cpu: int, env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(["taskset", "-c", str(cpu), *cmd], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=cwd)
        if self.nice:
            set_priority(p.pid, self.nice)
        self.procs.append((name, p))
        return p

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        p = dict(self.procs)[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise TargetFailed(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TargetFailed(f"{name} not ready at {url} after {timeout_s:.0f} s:\n{self.log_tail(name)}")

    def stop_all(self) -> None:
        for name, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs.clear()


def start_upstream(procs: Processes, cpu: int, settings: Settings) -> int:
    port = free_port()
    procs.spawn("fake_upstream", [sys.executable, str(ROOT / "benchmarks/fake_upstream.py"),
                                  "--port", str(port), "--model", MODEL], cpu)
    procs.wait_http("fake_upstream", f"http://127.0.0.1:{port}/health", settings.startup_timeout_s)
    return port


def start_direct(procs: Processes, settings: Settings, workdir: Path) -> tuple[str, str]:
    port = start_upstream(procs, TARGET_CPU, settings)
    return f"http://127.0.0.1:{port}", "unused"


def inferd_revision(rev: str) -> dict | None:
    """The commit an inferd target runs: short hash, its history's length (to order revisions), and
    whether the tree holds uncommitted changes in inferd/ (for "worktree" only). None if rev is no commit."""
    if rev == "worktree":
        commit = command_output(["git", "rev-parse", "--short", "HEAD"])
        dirty = bool(command_output(["git", "status", "--porcelain", "--", "inferd"]))
        return {"commit": commit, "history": int(command_output(["git", "rev-list", "--count", "HEAD"])) + 0.5,
                "dirty": dirty}
    commit = command_output(["git", "rev-parse", "--short", f"{rev}^{{commit}}"])
    if not commit:
        return None
    return {"commit": commit, "history": int(command_output(["git", "rev-list", "--count", commit])), "dirty": False}


def inferd_source(rev: str, dest: Path) -> Path:
    """The directory whose inferd/ the target runs. A commit is exported (git archive) to dest so that edits
    others make in the shared tree during the run cannot change what is measured; "worktree": the tree as it is."""
    if rev == "worktree":
        return ROOT
    dest.mkdir()
    archive = subprocess.run(["git", "archive", rev, "inferd"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def inferd_cli(args: list[str], env: dict, src: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "inferd.cli", *args], capture_output=True, text=True, env=env,
                       cwd=src, timeout=120)
    if r.returncode != 0:
        raise TargetFailed(f"inferd {' '.join(args[:2])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def start_inferd(procs: Processes, settings: Settings, workdir: Path, rev: str) -> tuple[str, str]:
    src = inferd_source(rev, workdir / "src")
    env = os.environ | {"PYTHONPATH": str(src)}  # and cwd=src: `python -m` puts the cwd first on sys.path
    upstream = start_upstream(procs, CLIENT_CPU, settings)
    db = f"sqlite:///{workdir / 'inferd.db'}"
    inferd_cli(["tenants", "create", "bench", "--db", db, "--tpm", str(settings.tpm_limit)], env, src)
    out = inferd_cli(["keys", "create", "--db", db, "--tenant", "bench", "--format", "json"], env, src)
    key = json.loads(out.strip().splitlines()[-1])["key"]
    port = free_port()
    procs.spawn("inferd", [sys.executable, "-m", "inferd.cli", "gateway", "--db", db, "--upstream",
                           f"http://127.0.0.1:{upstream}", "--model", MODEL, "--host", "127.0.0.1",
                           "--port", str(port)], TARGET_CPU, env, src)
    procs.wait_http("inferd", f"http://127.0.0.1:{port}/health", settings.startup_timeout_s)
    return f"http://127.0.0.1:{port}", key


def start_litellm(procs: Processes, settings: Settings, workdir: Path) -> tuple[str, str]:
    exe = ROOT / settings.litellm_venv / "bin" / "litellm"
    if not exe.exists():
        raise TargetFailed(f"{exe} not found: pip install {' '.join(LITELLM_PACKAGES)} into {settings.litellm_venv}")
    upstream = start_upstream(procs, CLIENT_CPU, settings)
    key = "sk-bench-" + os.urandom(16).hex()
    env = os.environ | {
        "BENCH_UPSTREAM_BASE": f"http://127.0.0.1:{upstream}/v1", "BENCH_LITELLM_KEY": key,
        "BENCH_TPM_LIMIT": str(settings.tpm_limit), "LITELLM_MASTER_KEY": "sk-master-" + os.urandom(16).hex(),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the model price list at start
        "LITELLM_TELEMETRY": "False",
    }
    port = free_port()
    procs.spawn("litellm", [str(exe), "--config", str(ROOT / "benchmarks/litellm/config.yaml"),
                            "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"], TARGET_CPU, env)
    procs.wait_http("litellm", f"http://127.0.0.1:{port}/health/liveliness", settings.startup_timeout_s)
    return f"http://127.0.0.1:{port}", key


STARTERS = {"direct": start_direct, "litellm": start_litellm}


def start_target(name: str, settings: Settings, workdir: Path) -> Target:
    """name: direct, litellm or inferd@COMMIT (or inferd@worktree)."""
    logdir = workdir / name
    logdir.mkdir()
    t = Target(name, Processes(logdir, settings.nice))
    kind, _, rev = name.partition("@")
    args = (t.procs, settings, logdir)
    try:
        t.base_url, t.key = start_inferd(*args, rev) if kind == "inferd" else STARTERS[kind](*args)
        t.pgid = t.procs.procs[-1][1].pid  # each starter spawns its target last, in a session of its own
        print(f"  {name}: up at {t.base_url}", flush=True)
    except TargetFailed as e:
        t.fail(str(e))
        t.procs.stop_all()
    return t


# ---- environment

def command_output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in command_output(["lscpu"]).splitlines()
                  if line.startswith("Model name")), platform.processor())
    return {"cpu": model, "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}


def versions(settings: Settings, inferd: dict) -> dict:
    py = str(ROOT / settings.litellm_venv / "bin" / "python")
    litellm = command_output([py, "-c", "import importlib.metadata as m; print(m.version('litellm'), "
                                        "m.version('uvicorn'), m.version('fastapi'))"]).split()
    from importlib.metadata import version
    return {"inferd": inferd,  # by target name: its commit, history length, uncommitted changes (worktree)
            "inferd_uvicorn": version("uvicorn"), "inferd_starlette": version("starlette"),
            "litellm": litellm[0] if litellm else None,
            "litellm_uvicorn": litellm[1] if len(litellm) > 1 else None,
            "litellm_fastapi": litellm[2] if len(litellm) > 2 else None}


# ---- report

def added(results: dict) -> None:
    base = results.get("direct", {})
    if base.get("status") != "ok":
        return
    for r in results.values():
        if r.get("status") == "ok":
            r["added_ms"] = {m: {s: r["latency"][m][s] - base["latency"][m][s] for s in ("p50", "p99")}
                             for m in ("nonstream_e2e_ms", "stream_ttfb_ms")}


def ratio(a: dict, b: dict) -> dict | None:
    """a's figures over b's (None where b's is 0, or where either target failed or there is no direct)."""
    if a.get("status") != "ok" or b.get("status") != "ok" or "added_ms" not in a:
        return None
    div = lambda x, y: x / y if y else None  # noqa: E731
    out = {f"added_{m}_{s}": div(a["added_ms"][m][s], b["added_ms"][m][s])
           for m in ("nonstream_e2e_ms", "stream_ttfb_ms") for s in ("p50", "p99")}
    out["max_rps"] = div(a["throughput"]["max_rps"], b["throughput"]["max_rps"])
    out["target_cpu_ms_per_request"] = div(a["throughput"]["target_cpu_ms_per_request"],
                                           b["throughput"]["target_cpu_ms_per_request"])
    return out


def ratios(results: dict, inferd: dict) -> dict:
    """"A / B": each inferd target over litellm, then for each pair of inferd revisions the later over the earlier."""
    pairs = [(name, "litellm") for name in inferd if "litellm" in results]
    by_age = sorted(inferd, key=lambda name: inferd[name]["history"])
    pairs += [(later, earlier) for i, earlier in enumerate(by_age) for later in by_age[i + 1:]]
    out = {f"{a} / {b}": ratio(results[a], results[b]) for a, b in pairs}
    return {k: v for k, v in out.items() if v}


LITELLM_NOTE = """\
LiteLLM's virtual keys (`/key/generate`, `tpm_limit` on the key) live in PostgreSQL,
reached through prisma-client-py. That client needs Prisma's Rust engines (query
engine, schema engine: prisma 0.15.0 uses Prisma CLI 5.17.0, engine commit 393aa359),
which it downloads on first use from Prisma's own binary host. This machine reaches only
PyPI, npm and Debian's archive, so the download fails (`prisma --version`: getaddrinfo
ENOTFOUND binaries.prisma.sh); no registry package ships the engines (npm
`@prisma/engines` fetches them in its postinstall) and they cannot be built here (their
Rust crates come from crates.io). A PostgreSQL 15 cluster itself starts fine here; it is
Prisma that cannot. Without a DB client LiteLLM refuses every key but the master key
(`No connected db.`).

So the key is defined in config instead: `benchmarks/litellm/custom_auth.py`, set as
LiteLLM's `custom_auth`, looks the presented key up by SHA-256 and returns the
`UserAPIKeyAuth` a DB key resolves to, with `tpm_limit` set. LiteLLM's own rate limiter
(`parallel_request_limiter` v3, in-memory counters, its default without Redis) checks and
counts that limit on every request exactly as for a DB key; with `tpm_limit` 50 the third
24-token request gets 429 `Rate limit exceeded for api_key`. Left out of LiteLLM's path
compared with a DB key: its in-memory key-cache lookup (the hook's dict lookup stands in)
and the in-memory spend-update queue a DB key feeds (flushed to the DB in the
background). Both are in-process work that this setup skips, so it can only make LiteLLM
look cheaper than with a DB key, not dearer.

Also installed beside `litellm[proxy]`: `opentelemetry-sdk`. Without it LiteLLM 1.108.7
retries a failing import of its OTel module on every request (`_seed_request_destinations`
in `user_api_key_auth.py`), about 7 % of the samples in a py-spy profile; with it the import
succeeds once. The model carries a per-token price (config.yaml), as a deployment that
tracks spend would set, so cost calculation takes its normal path. LiteLLM runs one
uvicorn worker (`--num_workers 1`), default logging, `LITELLM_LOCAL_MODEL_COST_MAP=True`
(no fetch of the price list at start)."""


def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(report: dict) -> str:
    s, res, v, m = report["settings"], report["targets"], report["versions"], report["machine"]
    inferd = "".join(f"{name} (the working tree at {r['commit']}{', uncommitted changes in inferd/' * r['dirty']}); "
                     if name.endswith("@worktree") else f"{name} (run from `git archive` of that commit); "
                     for name, r in v["inferd"].items())
    missing = [kind for kind in ALL_TARGETS if not any(name.partition("@")[0] == kind for name in res)]
    lines = ["# Gateway overhead: inferd against the LiteLLM proxy", "",
             *([f"Not in this run: {', '.join(missing)}.", ""] if missing else []),
             f"Date {report['date']}; machine: {m['cpu']}, {m['cpus']} cores, Linux {m['kernel']}, "
             f"Python {m['python']}; {inferd}LiteLLM {v['litellm']} "
             f"(uvicorn {v['litellm_uvicorn']}, FastAPI {v['litellm_fastapi']}). Load average before/after: "
             f"{report['loadavg_before'][0]:.2f}/{report['loadavg_after'][0]:.2f}. Python speed on core 1 "
             "(µs per `sum(range(1000))`, before each repeat and at the end; it drifts with the host): "
             f"{', '.join(f'{x:.1f}' for x in report['core1_speed_us'])}.", "",
             "Each target runs alone on core 1; the load generator (raw asyncio HTTP/1.1 client) and, behind a "
             "gateway, the fake upstream (benchmarks/fake_upstream.py: canned 8-token reply, no sleeps) share "
             "core 0. `direct` is the fake upstream alone on core 1: its figures are the floor, the client's "
             "own cost included, and \"added\" subtracts them. All targets stay up for the whole run and every "
             "repeat measures each in turn. "
             f"Latency: one connection, one request at a time, {s['latency_requests']} non-streaming then "
             f"{s['latency_requests']} streaming chat completions per run after {s['warmup_requests']} warm-up; "
             "TTFB = time to the first SSE `data:` line. Throughput: closed loop, non-streaming, "
             f"{s['duration_s']:g} s at each concurrency {', '.join(map(str, s['concurrencies']))}; "
             "CPU ms/request = CPU time of the target's processes over requests served, at its best concurrency. "
             f"Every figure is the median of {s['repeats']} runs. Both gateways: one key, TPM limit "
             f"{s['tpm_limit']:,} (checked on every request, never hit). Niceness {s['nice']}.", "",
             "| target | non-stream p50 ms | p99 ms | added p50 ms | added p99 ms | stream TTFB p50 ms | p99 ms "
             "| added p50 ms | added p99 ms | max req/s (at conc.) | CPU ms/request | errors |",
             "| --- |" + " ---: |" * 11]
    for name, r in res.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:120]} |" + " |" * 10)
            continue
        lat, add, tp = r["latency"], r.get("added_ms"), r["throughput"]
        cells = []
        for metric in ("nonstream_e2e_ms", "stream_ttfb_ms"):
            cells += [fmt(lat[metric]["p50"], 3), fmt(lat[metric]["p99"], 3)]
            cells += [fmt(add[metric][q] if add else None, 3) for q in ("p50", "p99")]
        cells += [f"{tp['max_rps']:.0f} ({tp['max_rps_concurrency']})", fmt(tp["target_cpu_ms_per_request"], 3),
                  str(lat["errors"] + tp["errors"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Requests/s by concurrency (median of runs):", "",
              "| target | " + " | ".join(f"c={c}" for c in s["concurrencies"]) + " |",
              "| --- |" + " ---: |" * len(s["concurrencies"])]
    ok = {name: r for name, r in res.items() if r["status"] == "ok"}
    for name, r in ok.items():
        by = {int(c): level for c, level in r["throughput"]["by_concurrency"].items()}  # str keys once in JSON
        lines.append(f"| {name} | " + " | ".join(f"{by[c]['rps_median']:.0f}" for c in s["concurrencies"]) + " |")
    gateways = [r["throughput"]["max_rps"] for name, r in ok.items() if name != "direct"]
    if "direct" in ok and gateways:
        ceiling = ok["direct"]["throughput"]["max_rps"]
        lines += ["", f"Load generator check: against `direct` the same client reaches {ceiling:.0f} req/s, "
                  f"{ceiling / max(gateways):.0f}x the fastest gateway, so it does not limit the gateways' figures."]
    if rt := report["ratios"]:
        lines += ["", "Ratios A ÷ B: each inferd target over LiteLLM, and for each pair of inferd revisions the later "
                  "over the earlier (latency and CPU: below 1 means A is cheaper; req/s: above 1 means A serves "
                  "more):", "",
                  "| A ÷ B | added non-stream p50 | p99 | added stream TTFB p50 | p99 | max req/s on one core "
                  "| gateway CPU ms/request |", "| --- |" + " ---: |" * 6]
        keys = [f"added_{m}_{q}" for m in ("nonstream_e2e_ms", "stream_ttfb_ms") for q in ("p50", "p99")]
        for pair, r in rt.items():
            lines.append(f"| {pair.replace(' / ', ' ÷ ')} | "
                         + " | ".join(fmt(r[k]) for k in [*keys, "max_rps", "target_cpu_ms_per_request"]) + " |")
    lines += ["", "## LiteLLM: key and TPM limit", "", LITELLM_NOTE, "", "## Reproduce", "",
              "```sh", "# creates benchmarks/.venvs/litellm on first use: python3.11 -m venv, pip install "
              "'litellm[proxy]' opentelemetry-sdk", "PYTHONPATH=. " + report["command"], "```", ""]
    return "\n".join(lines)


# ---- main

def parse_args() -> tuple[Settings, dict, Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(ALL_TARGETS),
                    help="comma-separated, of direct, inferd, inferd@REV (any number of them), litellm")
    ap.add_argument("--latency-requests", type=int, default=500)
    ap.add_argument("--warmup-requests", type=int, default=200)
    ap.add_argument("--concurrencies", default="1,4,16,64")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tpm-limit", type=int, default=10**9)
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of this process and every target, and of their session groups where the kernel's "
                         "autogroup scheduling is on (negative, as root: other jobs on the machine disturb less)")
    ap.add_argument("--inferd-rev", default="HEAD",
                    help="the commit a bare `inferd` target measures (default HEAD), exported to a temporary "
                         "directory; 'worktree': the working tree as it is, uncommitted changes included")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw")
    ap.add_argument("--litellm-venv", default=os.environ.get("LITELLM_VENV", LITELLM_VENV),
                    help="relative to the repository root or absolute; created on first use (default %(default)s)")
    ap.add_argument("--out", default="benchmarks/results/gateway", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    targets, inferd = [], {}
    for t in filter(None, a.targets.split(",")):
        kind, at, rev = t.partition("@")
        if kind not in ALL_TARGETS or (at and kind != "inferd"):
            ap.error(f"unknown target {t!r}")
        if kind == "inferd":
            rev = rev or a.inferd_rev
            if (r := inferd_revision(rev)) is None:
                ap.error(f"{t}: {rev} is not a commit of this repository")
            t = f"inferd@{'worktree' if rev == 'worktree' else r['commit']}"
            inferd[t] = r
        if t in targets:
            ap.error(f"target {t} given twice")
        targets.append(t)
    return Settings(targets=targets, latency_requests=a.latency_requests, warmup_requests=a.warmup_requests,
                    concurrencies=[int(c) for c in a.concurrencies.split(",")], duration_s=a.duration_s,
                    repeats=a.repeats, tpm_limit=a.tpm_limit, client=a.client, nice=a.nice, inferd_rev=a.inferd_rev,
                    litellm_venv=a.litellm_venv), inferd, Path(a.out)


def main() -> None:
    settings, inferd, out = parse_args()
    if "litellm" in settings.targets:
        from benchmarks.venvs import ensure_venv
        ensure_venv(ROOT / settings.litellm_venv, LITELLM_PACKAGES, " (a few minutes, once)")
    if settings.nice and os.getsid(0) != os.getpid():  # a session of our own, so its group's niceness is ours alone
        os.execvp("setsid", ["setsid", "--wait", sys.executable, *sys.argv])
    if len(os.sched_getaffinity(0) | {TARGET_CPU, CLIENT_CPU}) != len(os.sched_getaffinity(0)):
        sys.exit(f"needs cores {CLIENT_CPU} and {TARGET_CPU}; this process may use {sorted(os.sched_getaffinity(0))}")
    os.sched_setaffinity(0, {CLIENT_CPU})
    if settings.nice:
        set_priority(os.getpid(), settings.nice)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally that stops the targets
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                  "versions": versions(settings, inferd), "settings": asdict(settings),
                  "command": " ".join([".venv/bin/python", *sys.argv]), "targets": {}}
        report["loadavg_before"] = os.getloadavg()
        targets = [start_target(name, settings, Path(tmp)) for name in settings.targets]
        try:
            report["core1_speed_us"] = asyncio.run(measure_all(settings, targets))
        finally:
            for t in targets:
                t.procs.stop_all()
    report["targets"] = {t.name: summarize(t) for t in targets}
    report["loadavg_after"] = os.getloadavg()
    added(report["targets"])
    report["ratios"] = ratios(report["targets"], inferd)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
