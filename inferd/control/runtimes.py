"""Replicas that run another engine than inferd's: vLLM's OpenAI server, in its own Python environment.

Such a replica is a process on a loopback port with its own random key, like `inferd replica`, started from
the deployment's engine settings (EngineConfig: the ones vLLM honours become its flags; a setting it cannot
honour is refused by the spec) and `runtime.args`. Its model is the deployment's source as a Hugging Face
directory (a GGUF file is exported once: inferd.models.export). Ready means: /health answers and one real
one-token completion came back. vLLM runs with priority scheduling (the gateway's class becomes the request's
`priority`), prefix caching keyed by the request's `cache_salt` (the tenant), and prompt token details on
(`cached_tokens` in usage).
"""
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferd.control.kinds import source_path
from inferd.control.replicas import _die_with_parent, free_port, terminate
from inferd.control.spec import EngineChoice
from inferd.engine.config import EngineConfig
from inferd.models.cpu import has_native_bf16

log = logging.getLogger(__name__)

# EngineConfig fields vLLM honours (as flags below); every other field must keep its default
HONOURED = {"dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "max_model_len", "num_threads",
            "enable_prefix_caching", "scheduling_policy"}
VLLM_PYTHON_ENV = "INFERD_VLLM_PYTHON"  # the default interpreter for engine: vllm where the spec names none


def unsupported_settings(settings: EngineConfig) -> list[str]:
    """The engine settings a deployment changed from their defaults that vLLM cannot honour."""
    default = EngineConfig()
    return [name for name in EngineConfig.__dataclass_fields__
            if name not in HONOURED and getattr(settings, name) != getattr(default, name)]


def runtime_python(choice: EngineChoice) -> str | None:
    """The interpreter that runs the engine: the spec's, else $INFERD_VLLM_PYTHON, else the one of a `vllm`
    executable on PATH; None if none of those exists."""
    for candidate in (choice.python, os.environ.get(VLLM_PYTHON_ENV)):
        if candidate:
            path = Path(candidate).expanduser()
            return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    script = shutil.which("vllm")
    if script is None:
        return None
    first = Path(script).read_bytes()[:256].split(b"\n", 1)[0]
    return first[2:].decode().strip() if first.startswith(b"#!") else None


def vllm_command(python: str, model_dir: Path, name: str, settings: EngineConfig, args: list[str], host: str,
                 port: int) -> list[str]:
    """vLLM's OpenAI server for model_dir under name, with the deployment's settings as vLLM's flags (its
    module, not `vllm serve`: that CLI looks up the distribution `vllm`, which the CPU wheel is not)."""
    s = settings
    dtype = s.dtype if s.dtype != "auto" else "bfloat16" if has_native_bf16() else "float32"  # as inferd picks
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


def preloads(python: str) -> list[str]:
    """What vLLM's CPU backend wants preloaded for speed, where present: tcmalloc (Debian's
    libtcmalloc-minimal4) and the Intel OpenMP runtime its own requirements install into its venv."""
    tcmalloc = next((p for p in TCMALLOC if p.is_file()), None)
    iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    return [str(p) for p in (tcmalloc, iomp) if p is not None and p.is_file()]


TCMALLOC = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), Path("/usr/lib64/libtcmalloc_minimal.so.4")]


@dataclass(slots=True, eq=False)
class VllmProcess:
    """One vLLM OpenAI server on a loopback port, reachable only with its own random key (a ReplicaHandle)."""
    source: str | None  # the deployment's model source (None or "default": the packaged model)
    name: str  # the model id it serves: the deployment's name
    settings: EngineConfig
    choice: EngineChoice
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen | None = None
    started_unix_s: float = 0.0
    loaded_unix_s: float | None = None  # /health answered: the weights are in
    warm_unix_s: float | None = None  # the first real completion came back

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        from inferd.models.export import exported_dir
        python = runtime_python(self.choice)
        if python is None:
            raise RuntimeError("no Python with vLLM found: name one in the spec's runtime.python, set "
                               f"${VLLM_PYTHON_ENV}, or create one with scripts/install-vllm-cpu.sh")
        self.started_unix_s = time.time()
        model_dir = exported_dir(source_path("text", self.source))
        cmd = vllm_command(python, model_dir, self.name, self.settings, self.choice.args, self.host, self.port)
        env = os.environ | {"VLLM_API_KEY": self.api_key, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if self.settings.num_threads is not None:  # vLLM binds its OpenMP threads to these cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.settings.num_threads - 1}"
        if preload := preloads(python):
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
        # its own process group: its engine core and workers are stopped with it, even after it was killed
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, start_new_session=True)
        log.info("started vLLM replica pid %d on %s", self.proc.pid, self.url)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Until /health answers and a one-token completion comes back; raises if the process ends first."""
        deadline, auth = time.monotonic() + timeout_s, {"authorization": f"Bearer {self.api_key}"}
        with httpx.Client(timeout=30.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"vLLM replica on {self.url} exited with {self.proc.returncode} before it "
                                       "was ready")
                try:
                    if self.loaded_unix_s is None and client.get(f"{self.url}/health").status_code == 200:
                        self.loaded_unix_s = time.time()
                    if self.loaded_unix_s is not None:
                        r = client.post(f"{self.url}/v1/completions", headers=auth,
                                        json={"model": self.name, "prompt": "Hi", "max_tokens": 1})
                        if r.status_code == 200:
                            self.warm_unix_s = time.time()
                            return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"vLLM replica on {self.url} not ready after {timeout_s:.0f} s")

    def cold_start(self) -> dict:
        """When its weights were in and when its first completion came back, as inferd's /ready reports them."""
        return {"loaded_unix_s": self.loaded_unix_s, "warm_unix_s": self.warm_unix_s}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server (it stops its engine), SIGKILL after timeout_s; then whatever is left of its
        process group (the engine core and workers of a server that was killed)."""
        if self.proc is None:
            return
        terminate(self.proc, timeout_s)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
