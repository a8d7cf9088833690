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

from inferd.control.cpus import AUTO, cpulist, machine_cpus, parse_cpulist
from inferd.control.in_process import KINDS as IN_PROCESS_KINDS
from inferd.control.kinds import KINDS, SETTINGS, Settings, source_path
from inferd.control.probes import read_probes
from inferd.control.runtimes import RUNTIMES, EngineChoice, runtime_python, unsupported_settings
from inferd.eval.docset import DEFAULT_SET, SetError, load_set
from inferd.gateway.admission import QueueConfig
from inferd.gateway.config import ModelPrice
from inferd.gateway.degrade import DEGRADE_ACTIONS, DegradationSpec
from inferd.gateway.response_cache import ResponseCacheConfig
from inferd.router.router import RouterConfig
from inferd.settings import SettingError


class SpecError(ValueError):
    """A deployment spec that cannot be run; the message starts with the field's path."""


@dataclass(slots=True)
class ModelSpec:
    source: str = "default"  # a .gguf file, a Hugging Face directory, or "default" (the packaged SmolLM2)
    sha256: str | None = None  # pin: the weights file's digest (a directory: its safetensors, as the replica logs)


@dataclass(slots=True)
class ExternalSpec:
    base_url: str
    api_key_env: str | None = None  # the key is read from this environment variable, never written in the file
    model: str | None = None  # the upstream's model id (default: the deployment's name)
    tokenizer: str | None = None  # counts tokens for limits and billing (default: the packaged model's)
    max_model_len: int = 8192
    api: str = "openai"  # the protocol it speaks: openai (chat completions) or anthropic (messages)
    auth: str | None = None  # how the key is sent: bearer, or x-api-key (None: the api's own way)
    api_version: str = "2024-10-21"  # Azure OpenAI's api-version


ENGINES = ("inferd", "vllm", "llama.cpp")
EXTERNAL_APIS = ("openai", "anthropic", "azure", "gemini", "bedrock")


PLACEMENTS = ("local", "in_process", "ray")
ROLES = ("stable", "canary")


@dataclass(slots=True)
class PlacementSpec:
    # local processes; in_process: inside the gateway's process (classical and policy models only: no second hop,
    # no isolation, the gateway's GIL; control/in_process.py); ray: Ray actors on any node of a Ray cluster
    backend: str = "local"
    ray_address: str | None = None  # ray.init(address=...); None: the cluster RAY_ADDRESS names, else a local one
    num_cpus: float = 1.0  # Ray resources one replica reserves
    num_gpus: float = 0.0
    # local replicas: the CPUs they run on, "auto" (control/cpus.py: docs/cpus.md) or a cpulist such as "0-3,6";
    # a number is one CPU (YAML reads `cpus: 3` as one)
    cpus: str | int = AUTO

    def __post_init__(self):
        self.cpus = str(self.cpus)


@dataclass(slots=True)
class AutoscalingSpec:
    """Replicas between min and max, from queue age, waiting tokens, KV usage and TTFT against its target."""
    min_replicas: int = 1
    max_replicas: int = 1
    scale_to_zero: bool = False  # min_replicas 0 is allowed only with this; the first request then waits
    target_ttft_ms: float | None = None  # the SLO: TTFT p95 over the window
    target_queue_age_ms: float = 2000.0
    max_waiting_tokens_per_replica: int = 8192
    max_kv_usage: float = 0.9
    upscale_delay_s: float = 5.0  # a signal must hold this long before a replica is added
    downscale_delay_s: float = 60.0  # and this long (idle enough) before one is drained
    max_replica_hours_per_hour: float | None = None  # cost ceiling: average replicas over the last hour
    drain_timeout_s: float = 30.0  # running streams get this long to finish when a replica is stopped
    window_s: float = 30.0  # the window TTFT p95 is computed over
    interval_s: float = 1.0


@dataclass(slots=True)
class RolloutSpec:
    """How a canary version is judged against the stable one over a window."""
    weight: float = 0.1  # share of the name's traffic the canary takes once started
    window_s: float = 60.0
    min_requests: int = 20  # canary requests needed before a decision
    max_error_rate_increase: float = 0.02
    max_ttft_p95_ratio: float = 1.5
    max_tpot_p95_ratio: float = 1.5
    max_cost_ratio: float = 1.25  # cost per request, canary / stable
    probes: str | None = None  # a JSONL probe set: {"messages": [...], "expect": "regex"} per line
    min_probe_score: float = 1.0  # share of probes the canary must pass
    auto: bool = True  # promote or roll back by these rules without an operator


@dataclass(slots=True)
class QualityFloor:
    """The least accuracy (0..1) a version must reach on its quality set, per metric; None: not gated."""
    answer: float | None = None
    decline: float | None = None
    conflict: float | None = None
    citation: float | None = None
    overall: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(slots=True)
class QualitySpec:
    """A text version's quality set: run against it before it takes traffic (the release gate: below the floor
    it does not start) and, on a canary, against canary and stable to compare them (inferd.control.quality)."""
    set: str = "default"  # an eval set folder; default: evals/docqa-v1 of this source checkout
    split: str = "acceptance"
    floor: QualityFloor = field(default_factory=QualityFloor)
    limit: int | None = None  # only the first N items of each behaviour (quick checks; wider intervals)
    concurrency: int = 4  # requests in flight while the set runs


def set_path(q: QualitySpec) -> Path:
    """The folder of q's eval set."""
    return DEFAULT_SET if q.set == "default" else Path(q.set).expanduser()


@dataclass(slots=True)
class DeploymentSpec:
    name: str
    kind: str = "text"  # one of kinds.KINDS: text (chat, completions) | embedding | classical (tabular) | policy
    version: str = "v1"
    role: str = "stable"  # or "canary": a second version of a stable deployment's name
    model: ModelSpec | None = None
    runtime: Settings | None = None  # the kind's settings (kinds.SETTINGS); None: defaults
    engine: EngineChoice = field(default_factory=EngineChoice, metadata={"setting": False})  # runtime.engine etc.
    replicas: int = 1  # replicas at start (within autoscaling's min and max when it is set)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    autoscaling: AutoscalingSpec | None = None
    rollout: RolloutSpec | None = None  # on a canary: how it is judged
    quality: QualitySpec | None = None  # the release gate's set and floor (text only)
    external: ExternalSpec | None = None
    fallbacks: list[str] = field(default_factory=list)  # deployments that take a request this one fails
    degradation: DegradationSpec | None = None
    price: ModelPrice = field(default_factory=ModelPrice)
    queue: QueueConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    response_cache: ResponseCacheConfig | None = None  # exact-match answers (gateway/response_cache.py); None: off

    def __post_init__(self):  # the kind itself is checked as the file is read (build)
        if self.runtime is None:
            self.runtime = SETTINGS[self.kind]()


@dataclass(slots=True)
class ServiceSpec:
    deployments: list[DeploymentSpec]


# loading

def load_spec(path: str | Path, verify_digests: bool = True) -> ServiceSpec:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(str(exc)) from None  # its callers name the file
    spec = build(ServiceSpec, raw, "")
    check(spec, verify_digests)
    return spec


def build(cls: type, raw: Any, where: str) -> Any:
    """A dataclass from YAML data, strictly: every field known, every value of its declared type (fields with
    metadata setting=False are set by code, not by the file)."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where or 'the file'}: expected a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls) if f.metadata.get("setting", True)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SpecError(f"{_at(where, unknown[0])}: unknown field (known: {', '.join(known)})")
    hints = typing.get_type_hints(cls)
    engine = None
    if cls is DeploymentSpec:  # the runtime's fields are the kind's, beside which engine runs them
        kind = raw.get("kind", "text")
        if kind not in SETTINGS:
            raise SpecError(f"{_at(where, 'kind')}: must be one of {', '.join(KINDS)}; got {kind!r}")
        hints["runtime"] = SETTINGS[kind] | None
        if isinstance(raw.get("runtime"), dict):
            runtime = dict(raw["runtime"])
            engine = build(EngineChoice, {k: runtime.pop(k) for k in fields_of(EngineChoice) if k in runtime},
                           _at(where, "runtime"))
            raw = dict(raw, runtime=runtime)
    values = {name: _value(hints[name], raw[name], _at(where, name)) for name in raw}
    if engine is not None:
        values["engine"] = engine
    for name, f in known.items():
        if name not in values and f.default is MISSING and f.default_factory is MISSING:
            raise SpecError(f"{_at(where, name)}: required")
    try:
        return cls(**values)
    except SettingError as exc:
        raise SpecError(f"{_at(where, exc.name)}: {exc.problem}") from None
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{where or 'the file'}: {exc}") from None


def fields_of(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


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
    seen: set[tuple[str, str]] = set()
    stable = {d.name for d in spec.deployments if d.role == "stable"}
    kinds = {d.name: d.kind for d in spec.deployments if d.role == "stable"}
    for i, d in enumerate(spec.deployments):
        where = f"deployments[{i}]"
        if d.role not in ROLES:
            raise SpecError(f"{where}.role: must be one of {', '.join(ROLES)}")
        if (d.name, d.role) in seen:
            raise SpecError(f"{where}.name: '{d.name}' has two {d.role} versions")
        seen.add((d.name, d.role))
        if d.role == "canary":
            _check_canary(spec, d, where)
        elif d.rollout is not None:
            raise SpecError(f"{where}.rollout: only a canary (role: canary) has a rollout policy")
        for j, name in enumerate(d.fallbacks):
            if name not in stable or name == d.name:
                raise SpecError(f"{where}.fallbacks[{j}]: '{name}' is not another deployment of this file")
            if kinds[name] != d.kind:
                raise SpecError(f"{where}.fallbacks[{j}]: '{name}' is a {kinds[name]} deployment, not {d.kind}")
        if d.degradation is not None:
            _check_degradation(d.degradation, stable - {d.name}, f"{where}.degradation")
        if d.quality is not None:
            _check_quality(d, f"{where}.quality")
        if d.response_cache is not None:
            _check_response_cache(d, f"{where}.response_cache")
        if (d.model is None) == (d.external is None):
            raise SpecError(f"{where}: give exactly one of model (local replicas) and external (a base URL)")
        _check_cpus(d, f"{where}.placement.cpus")
        if d.external is not None:
            _check_external(d.external, f"{where}.external")
            if d.autoscaling is not None:
                raise SpecError(f"{where}.autoscaling: an external deployment has no replicas to scale")
            continue
        _check_runtime(d.runtime, f"{where}.runtime")
        _check_engine(d, f"{where}.runtime")
        if d.kind != "text" and (d.degradation is not None or d.external is not None):
            raise SpecError(f"{where}: degradation and external replicas are for text deployments only")
        _check_replicas(d, where)
        if d.placement.backend not in PLACEMENTS:
            raise SpecError(f"{where}.placement.backend: must be one of {', '.join(PLACEMENTS)}")
        if d.placement.backend == "in_process" and (d.kind not in IN_PROCESS_KINDS or d.engine.engine != "inferd"):
            raise SpecError(f"{where}.placement.backend: in_process runs {' and '.join(IN_PROCESS_KINDS)} models "
                            f"only; give local or ray for a {d.kind} model")
        if d.placement.num_cpus <= 0 or d.placement.num_gpus < 0:
            raise SpecError(f"{where}.placement: num_cpus must be above 0 and num_gpus at least 0")
        if verify_digests:
            _check_digest(d.kind, d.model, f"{where}.model")
        if d.kind == "classical":
            _check_classical(d, where)


def _check_response_cache(d: DeploymentSpec, where: str) -> None:
    c = d.response_cache
    if d.kind not in ("text", "embedding"):
        raise SpecError(f"{where}: a response cache is for text and embedding deployments; a {d.kind} model's "
                        "answers are not kept")
    if c.ttl_s <= 0 or c.max_bytes <= 0:
        raise SpecError(f"{where}: ttl_s and max_bytes must be above 0")


def _check_cpus(d: DeploymentSpec, where: str) -> None:
    """A cpulist: local replicas, CPUs this machine gives inferd, at least as many as the runtime's threads."""
    if d.placement.cpus == AUTO:
        return
    if d.external is not None or d.placement.backend != "local":
        raise SpecError(f"{where}: only local replicas are pinned to CPUs (an external deployment, Ray's replicas "
                        "or those in the gateway's process: leave it auto)")
    try:
        cpus = parse_cpulist(d.placement.cpus)
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None
    if missing := sorted(set(cpus) - set(machine_cpus())):
        raise SpecError(f"{where}: no CPU {cpulist(missing)} here (inferd may use {cpulist(machine_cpus())})")
    threads = getattr(d.runtime, "num_threads", None)
    if threads is not None and threads > len(cpus):
        raise SpecError(f"{where}: {cpulist(cpus)} is {len(cpus)} CPU(s), fewer than runtime.num_threads {threads}")


def _check_canary(spec: ServiceSpec, d: DeploymentSpec, where: str) -> None:
    stable = next((s for s in spec.deployments if s.name == d.name and s.role == "stable"), None)
    if stable is None:
        raise SpecError(f"{where}.role: a canary needs a stable deployment named '{d.name}'")
    if stable.version == d.version:
        raise SpecError(f"{where}.version: the canary must differ from the stable version '{d.version}'")
    if d.price != ModelPrice() and d.price != stable.price:
        raise SpecError(f"{where}.price: a canary is billed at its name's price; leave it out or repeat the stable's")
    r = d.rollout
    if r is None:
        return
    if not 0 < r.weight < 1:
        raise SpecError(f"{where}.rollout.weight: must be between 0 and 1 (exclusive)")
    if r.window_s <= 0 or r.min_requests < 1:
        raise SpecError(f"{where}.rollout: window_s must be above 0 and min_requests at least 1")
    if r.probes is not None and not Path(r.probes).expanduser().is_file():
        raise SpecError(f"{where}.rollout.probes: {r.probes} is not a file")
    if r.probes is not None:
        try:
            read_probes(r.probes)
        except ValueError as exc:
            raise SpecError(f"{where}.rollout.probes: {r.probes}: {exc}") from None
    if not 0 <= r.min_probe_score <= 1:
        raise SpecError(f"{where}.rollout.min_probe_score: must be between 0 and 1")


def _check_quality(d: DeploymentSpec, where: str) -> None:
    q = d.quality
    if d.kind != "text":
        raise SpecError(f"{where}: a quality set is for text deployments only")
    try:
        load_set(set_path(q)).split(q.split)
    except SetError as exc:
        raise SpecError(f"{where}: {exc}") from None
    for name, value in q.floor.as_dict().items():
        if not 0 <= value <= 1:
            raise SpecError(f"{where}.floor.{name}: a share between 0 and 1")
    if (q.limit is not None and q.limit < 1) or q.concurrency < 1:
        raise SpecError(f"{where}: limit and concurrency must be at least 1")


def _check_replicas(d: DeploymentSpec, where: str) -> None:
    a = d.autoscaling
    if a is None:
        if d.replicas < 1:
            raise SpecError(f"{where}.replicas: must be at least 1")
        return
    if a.min_replicas < 0 or a.max_replicas < max(a.min_replicas, 1):
        raise SpecError(f"{where}.autoscaling: need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
    if a.min_replicas == 0 and not a.scale_to_zero:
        raise SpecError(f"{where}.autoscaling.min_replicas: 0 needs scale_to_zero: true")
    if not a.min_replicas <= d.replicas <= a.max_replicas:
        raise SpecError(f"{where}.replicas: {d.replicas} is outside autoscaling's "
                        f"[{a.min_replicas}, {a.max_replicas}]")
    for name in ("upscale_delay_s", "downscale_delay_s", "drain_timeout_s", "window_s", "interval_s"):
        if getattr(a, name) < 0 or (name in ("window_s", "interval_s") and getattr(a, name) == 0):
            raise SpecError(f"{where}.autoscaling.{name}: must be above 0")
    if not 0 < a.max_kv_usage <= 1:
        raise SpecError(f"{where}.autoscaling.max_kv_usage: must be in (0, 1]")
    if a.max_replica_hours_per_hour is not None and a.max_replica_hours_per_hour < max(a.min_replicas, 1):
        raise SpecError(f"{where}.autoscaling.max_replica_hours_per_hour: below min_replicas")


def _check_degradation(g: DegradationSpec, others: set[str], where: str) -> None:
    from inferd.gateway.policy import PRIORITY_CLASSES
    if not g.steps:
        raise SpecError(f"{where}.steps: at least one step is needed")
    for i, step in enumerate(g.steps):
        at = f"{where}.steps[{i}]"
        if step.action not in DEGRADE_ACTIONS:
            raise SpecError(f"{at}.action: must be one of {', '.join(DEGRADE_ACTIONS)}")
        if step.action == "cap_max_tokens" and (step.max_tokens is None or step.max_tokens < 1):
            raise SpecError(f"{at}.max_tokens: cap_max_tokens needs a cap of at least 1")
        if step.action == "route" and step.to not in others:
            raise SpecError(f"{at}.to: route needs another deployment of this file, got {step.to!r}")
        if step.priority_class is not None and step.priority_class not in PRIORITY_CLASSES:
            raise SpecError(f"{at}.priority_class: must be one of {', '.join(PRIORITY_CLASSES)}")
    if g.overload_queue_age_ms <= 0 or g.sustain_s < 0:
        raise SpecError(f"{where}: overload_queue_age_ms must be above 0 and sustain_s at least 0")


def _check_classical(d: DeploymentSpec, where: str) -> None:
    """What a classical replica would refuse at load: an unknown format, a pickle without its opt-in."""
    from inferd.classical.formats import FORMATS
    if d.model.source == "default":
        return
    path = Path(d.model.source).expanduser()
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise SpecError(f"{where}.model.source: unknown format {path.suffix!r} (known: {', '.join(sorted(FORMATS))})")
    if kind == "pickle" and not (d.runtime.allow_pickle and d.runtime.pickle_sha256):
        raise SpecError(f"{where}.runtime.allow_pickle: {path.name} is a pickle, which runs code when loaded; it "
                        "needs allow_pickle: true and its pickle_sha256")


def _check_runtime(r: Settings, where: str) -> None:
    """What depends on this machine; the values themselves the settings' own type checks."""
    m = getattr(r, "speculative_model", None)
    if m is not None and not (m.startswith("layers:") and m[7:].isdigit()) and not Path(m).expanduser().exists():
        raise SpecError(f"{where}.speculative_model: {m} is neither layers:N nor an existing model path")
    cores = os.cpu_count() or 1
    if r.num_threads is not None and r.num_threads > cores:
        raise SpecError(f"{where}.num_threads: {r.num_threads} threads, but this machine has {cores} cores")


def _check_engine(d: DeploymentSpec, where: str) -> None:
    """Another runtime than inferd's engine: a text deployment, placed locally, whose settings it honours."""
    e = d.engine
    if e.engine not in ENGINES:
        raise SpecError(f"{where}.engine: must be one of {', '.join(ENGINES)}; got {e.engine!r}")
    if e.engine == "inferd":
        if e.python is not None or e.args:
            raise SpecError(f"{where}.python: python and args are for another engine (engine: vllm)")
        return
    if d.kind != "text":
        raise SpecError(f"{where}.engine: {e.engine} serves text deployments only, not {d.kind}")
    for name in unsupported_settings(e.engine, d.runtime):
        raise SpecError(f"{where}.{name}: {e.engine} cannot honour this setting; leave it at its default")
    if e.engine == "llama.cpp" and d.model and source_path(d.kind, d.model.source).suffix != ".gguf":
        raise SpecError(f"{where}.engine: llama.cpp serves a .gguf file; the model's source is not one")
    if runtime_python(e) is None:
        raise SpecError(f"{where}.python: no Python with {e.engine} found (name its venv's python here, set "
                        f"${RUNTIMES[e.engine].python_env}, or create one: {RUNTIMES[e.engine].install})")


def _check_external(e: ExternalSpec, where: str) -> None:
    if not e.base_url.startswith(("http://", "https://")):
        raise SpecError(f"{where}.base_url: must be an http(s) URL")
    if e.api not in EXTERNAL_APIS:
        raise SpecError(f"{where}.api: must be one of {', '.join(EXTERNAL_APIS)}")
    if e.auth not in (None, "bearer", "x-api-key") or e.auth == "x-api-key" and e.api == "openai":
        raise SpecError(f"{where}.auth: bearer, or x-api-key for api: anthropic")
    if e.api == "bedrock":
        _check_bedrock(e, where)
    if e.api_key_env is not None and e.api_key_env not in os.environ:
        raise SpecError(f"{where}.api_key_env: ${e.api_key_env} is not set")


def _check_bedrock(e: ExternalSpec, where: str) -> None:
    """What signing its requests needs: botocore, a region, and credentials (or a Bedrock API key)."""
    try:
        import botocore.session
    except ImportError:
        raise SpecError(f"{where}.api: bedrock needs botocore (pip install 'inferd[providers]')") from None
    from inferd.gateway.providers import BEDROCK_HOST
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not BEDROCK_HOST.search(e.base_url) and not region:
        raise SpecError(f"{where}.base_url: not bedrock-runtime.REGION.amazonaws.com, and $AWS_REGION is not set")
    if e.api_key_env is None and botocore.session.get_session().get_credentials() is None:
        raise SpecError(f"{where}: no AWS credentials found (the environment, ~/.aws, an instance role), and no "
                        "api_key_env with a Bedrock API key")


def _check_digest(kind: str, m: ModelSpec, where: str) -> None:
    path = source_path(kind, m.source)
    if not path.exists():
        raise SpecError(f"{where}.source: {path} does not exist")
    if m.sha256 is None:
        return
    from inferd.models import hf
    actual = hf.sha256_files([path] if path.is_file() else hf.safetensors_files(path))  # as the replica logs it
    if actual != m.sha256.lower():
        raise SpecError(f"{where}.sha256: the model's digest is {actual}, not the pinned {m.sha256}")
