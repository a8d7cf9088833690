"""The deployment spec (YAML): what a service runs, validated before anything starts.

Unknown fields, values this runtime cannot honour, and a model file whose sha256 differs from the pinned
digest are errors that name the field (e.g. `deployments[0].runtime.max_num_seqs`); nothing is ignored.
"""
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from inferd.gateway.admission import QueueConfig
from inferd.gateway.config import ModelPrice
from inferd.router.router import RouterConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


class SpecError(ValueError):
    """A deployment spec that cannot be run; the message starts with the field's path."""


@dataclass(slots=True)
class ModelSpec:
    source: str = "default"  # a .gguf file, a Hugging Face directory, or "default" (the packaged SmolLM2)
    sha256: str | None = None  # pin: the weights file's digest (a directory: its safetensors, as the replica logs)


@dataclass(slots=True)
class RuntimeSpec:
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    num_threads: int | None = None  # the replica shape on CPU: threads per replica
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class ExternalSpec:
    base_url: str
    api_key_env: str | None = None  # the key is read from this environment variable, never written in the file
    model: str | None = None  # the upstream's model id (default: the deployment's name)
    tokenizer: str | None = None  # counts tokens for limits and billing (default: the packaged model's)
    max_model_len: int = 8192


@dataclass(slots=True)
class DeploymentSpec:
    name: str
    version: str = "v1"
    model: ModelSpec | None = None
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    replicas: int = 1
    external: ExternalSpec | None = None
    price: ModelPrice = field(default_factory=ModelPrice)
    queue: QueueConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)


@dataclass(slots=True)
class ServiceSpec:
    deployments: list[DeploymentSpec]


# loading

def load_spec(path: str | Path, verify_digests: bool = True) -> ServiceSpec:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    spec = build(ServiceSpec, raw, "")
    check(spec, verify_digests)
    return spec


def build(cls: type, raw: Any, where: str) -> Any:
    """A dataclass from YAML data, strictly: every field known, every value of its declared type."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where or 'the file'}: expected a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SpecError(f"{_at(where, unknown[0])}: unknown field (known: {', '.join(known)})")
    hints = typing.get_type_hints(cls)
    values = {name: _value(hints[name], raw[name], _at(where, name)) for name in raw}
    for name, f in known.items():
        if name not in values and f.default is MISSING and f.default_factory is MISSING:
            raise SpecError(f"{_at(where, name)}: required")
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{where or 'the file'}: {exc}") from None


def _value(hint: Any, raw: Any, where: str) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if raw is None:
        if type(None) in options:
            return None
        raise SpecError(f"{where}: must not be empty")
    for option in (o for o in options if o is not type(None)):
        if is_dataclass(option):
            return build(option, raw, where)
        if typing.get_origin(option) is list:
            if not isinstance(raw, list):
                raise SpecError(f"{where}: expected a list")
            item = typing.get_args(option)[0]
            return [_value(item, r, f"{where}[{i}]") for i, r in enumerate(raw)]
        if option is float and type(raw) in (int, float) or type(raw) is option:
            return float(raw) if option is float else raw
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise SpecError(f"{where}: expected {names}, got {raw!r}")


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# what the runtime can honour

def check(spec: ServiceSpec, verify_digests: bool = True) -> None:
    if not spec.deployments:
        raise SpecError("deployments: at least one is needed")
    seen: set[str] = set()
    for i, d in enumerate(spec.deployments):
        where = f"deployments[{i}]"
        if d.name in seen:
            raise SpecError(f"{where}.name: '{d.name}' is declared twice")
        seen.add(d.name)
        if (d.model is None) == (d.external is None):
            raise SpecError(f"{where}: give exactly one of model (local replicas) and external (a base URL)")
        if d.external is not None:
            _check_external(d.external, f"{where}.external")
            continue
        _check_runtime(d.runtime, f"{where}.runtime")
        if d.replicas < 1:
            raise SpecError(f"{where}.replicas: must be at least 1")
        if verify_digests:
            _check_digest(d.model, f"{where}.model")


def _check_runtime(r: RuntimeSpec, where: str) -> None:
    if r.dtype not in DTYPES:
        raise SpecError(f"{where}.dtype: must be one of {', '.join(DTYPES)}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_threads"):
        value = getattr(r, name)
        if value is not None and value < 1:
            raise SpecError(f"{where}.{name}: must be at least 1")
    if r.kv_cache_gib <= 0:
        raise SpecError(f"{where}.kv_cache_gib: must be above 0")
    cores = os.cpu_count() or 1
    if r.num_threads is not None and r.num_threads > cores:
        raise SpecError(f"{where}.num_threads: {r.num_threads} threads, but this machine has {cores} cores")


def _check_external(e: ExternalSpec, where: str) -> None:
    if not e.base_url.startswith(("http://", "https://")):
        raise SpecError(f"{where}.base_url: must be an http(s) URL")
    if e.api_key_env is not None and e.api_key_env not in os.environ:
        raise SpecError(f"{where}.api_key_env: ${e.api_key_env} is not set")


def _check_digest(m: ModelSpec, where: str) -> None:
    from inferd.models.loader import default_model_path
    path = default_model_path() if m.source == "default" else Path(m.source).expanduser()
    if not path.exists():
        raise SpecError(f"{where}.source: {path} does not exist")
    if m.sha256 is None:
        return
    from inferd.models import hf
    actual = hf.sha256_files([path] if path.is_file() else hf.safetensors_files(path))  # as the replica logs it
    if actual != m.sha256.lower():
        raise SpecError(f"{where}.sha256: the model's digest is {actual}, not the pinned {m.sha256}")
