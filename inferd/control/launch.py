"""From a deployment spec (or `inferd serve` flags) to running replicas and the gateway's deployments."""
import argparse
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferd.control.cpus import AUTO, Shares, allocate, cpulist, machine_cpus
from inferd.control.in_process import InProcessReplica
from inferd.control.placement import make_replica
from inferd.control.pool import ReplicaPool, per_replica_slots
from inferd.control.replicas import ReplicaHandle, ReplicaProcess
from inferd.control.spec import DeploymentSpec, ModelSpec, ServiceSpec
from inferd.control.kinds import Settings, model_from_files, source_path
from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.models.sentence import DEFAULT_EMBEDDING_NAME
from inferd.gateway.config import GatewayConfig
from inferd.gateway.degrade import Degrader
from inferd.gateway.response_cache import ResponseCache
from inferd.gateway.deployments import Deployment, Deployments, Upstream
from inferd.gateway.providers import AnthropicTransport, AzureTransport, BedrockTransport, GeminiTransport
from inferd.gateway.transport import UpstreamTransport
from inferd.router.router import Router
from inferd.control.gateway_setup import deployment_for
from inferd.settings import flags_of

log = logging.getLogger(__name__)

FLAGS_TEXT = "replica"  # `inferd serve`'s text deployment from flags, named as its replicas are

@dataclass(slots=True)
class DeploymentPlan:
    spec: DeploymentSpec | None  # None: one deployment from `inferd serve` flags
    replicas: list[ReplicaHandle] = field(default_factory=list)  # the ones started before the gateway
    make: Callable[[], ReplicaHandle] | None = None  # one more replica of it (None: an external deployment)
    pool: ReplicaPool | None = None  # keeps its replicas (start_deployments makes it)


def local_plans(args: argparse.Namespace, replica_args: list[str], cpus: list[int] | None = None) -> \
        list[DeploymentPlan]:
    make = functools.partial(ReplicaProcess, replica_args, cpus)
    return [DeploymentPlan(None, [make() for _ in range(args.replicas)], make)]


def spec_plans(spec: ServiceSpec, log_flags: Sequence[str] = (),
               cpus: dict[str, list[int] | None] | None = None,
               transport: UpstreamTransport | None = None) -> list[DeploymentPlan]:
    """Each deployment's plan; its local replicas run on cpus[replica_prefix(d)] (cpu_shares; absent: all), its
    in-process ones (placement.backend in_process) behind transport, the gateway's."""
    plans = []
    for d in spec.deployments:
        make, share = None, (cpus or {}).get(replica_prefix(d))
        if d.model and d.placement.backend == "in_process":
            if transport is None:
                raise ValueError(f"{d.name}: an in-process replica needs the gateway's transport")
            make = functools.partial(InProcessReplica, d.kind, d.model.source, d.name, d.runtime, transport)
        elif d.model and d.engine.engine != "inferd":
            from inferd.control.runtimes import RuntimeProcess
            runtime = functools.partial(RuntimeProcess, d.model.source, d.name, d.runtime, d.engine, share)
            make = functools.partial(make_replica, d.placement, [], runtime)
        elif d.model:
            args = replica_args(d.model.source, d.name, d.runtime, log_flags, d.kind)
            make = functools.partial(make_replica, d.placement, args, cpus=share)
        plans.append(DeploymentPlan(d, [make() for _ in range(d.replicas)] if make else [], make))
    return plans


def cpu_shares(specs: Sequence[DeploymentSpec], flags_text: bool = False) -> tuple[Shares, str]:
    """The CPUs of each deployment with local replicas (by replica_prefix; with flags_text also `inferd serve`'s
    text model from flags, FLAGS_TEXT) and the gateway's (control/cpus.py), and a line that says so for the log."""
    wanted = [(FLAGS_TEXT, "text", AUTO)] if flags_text else []
    wanted += [(replica_prefix(d), d.kind, d.placement.cpus) for d in specs
               if d.external is None and d.placement.backend == "local"]
    shares = allocate(machine_cpus(), wanted)
    kinds = {name: kind for name, kind, _ in wanted}
    return shares, (f"CPUs {cpulist(machine_cpus())}: gateway {_shown(shares.gateway)}"
                    + "".join(f"; {name} ({kinds[name]}) {_shown(cpus)}" for name, cpus in shares.deployments.items()))


def _shown(cpus: list[int] | None) -> str:
    return "all" if cpus is None else cpulist(cpus)


def replica_prefix(d: DeploymentSpec) -> str:
    """What a deployment's replicas are named after: its name, a canary's with its version."""
    return d.name if d.role == "stable" else f"{d.name}-{d.version}"


def embedding_spec(source: str = "default") -> DeploymentSpec:
    """`inferd serve`'s embedding deployment beside its text model: the packaged all-MiniLM-L6-v2 by default."""
    name = DEFAULT_EMBEDDING_NAME if source == "default" else Path(source).stem
    return DeploymentSpec(name=name, kind="embedding", model=ModelSpec(source))


def classical_spec(source: str = "default") -> DeploymentSpec:
    """`inferd serve`'s classical deployment: the demo iris classifier by default (trained on first start)."""
    from inferd.classical.demo import DEMO_NAME
    name = DEMO_NAME if source == "default" else Path(source).name.rsplit(".", 1)[0]
    return DeploymentSpec(name=name, kind="classical", model=ModelSpec(source))


def policy_spec(source: str = "default") -> DeploymentSpec:
    """`inferd serve`'s robot policy deployment: the demo reacher policy by default."""
    from inferd.policy.demo import DEMO_NAME
    name = DEMO_NAME if source == "default" else Path(source).name
    return DeploymentSpec(name=name, kind="policy", model=ModelSpec(source))


def replica_args(model: str | None, served_model_name: str | None, settings: Settings,
                 log_flags: Sequence[str] = (), kind: str = "text") -> list[str]:
    """`inferd replica` arguments: the kind, the model (None or "default": the packaged one), its name, and
    the kind's settings."""
    out = [] if kind == "text" else ["--kind", kind]
    out += [] if model in (None, "default") else [model]
    out += ["--served-model-name", served_model_name] if served_model_name else []
    return out + flags_of(settings) + list(log_flags)


def start_deployments(plans: list[DeploymentPlan], config: GatewayConfig) -> Deployments:
    """Starts every local replica, waits until each has run a real inference, then builds the deployments
    and a replica pool for each local one (plan.pool; run them with the gateway: run_gateway's services)."""
    started, ready = {}, {}
    for plan in plans:
        for r in plan.replicas:
            started[id(r)] = time.time()
            r.start()
    for plan in plans:
        for r in plan.replicas:
            r.wait_ready()
            ready[id(r)] = time.time()
    deployments = Deployments()
    for plan in plans:
        deployment = _deployment(plan, config)
        deployments.add(deployment, canary=plan.spec is not None and plan.spec.role == "canary")
        if plan.make is not None:
            plan.pool = _pool(plan, deployment)
            for r in plan.replicas:
                plan.pool.adopt(r, started[id(r)], ready[id(r)])
    return deployments


def stop_all(plans: list[DeploymentPlan]) -> None:
    """Every replica `inferd serve` started, stopped (idempotent; whatever state start-up reached)."""
    for plan in plans:
        if plan.pool is not None:
            plan.pool.close_now()
        for r in plan.replicas:
            r.stop()


def _pool(plan: DeploymentPlan, deployment: Deployment) -> ReplicaPool:
    d, initial = plan.spec, len(plan.replicas)
    slots = per_replica_slots(deployment.queue.config.max_inflight, initial, slots_of(d) if d else 1)
    prefix = FLAGS_TEXT if d is None else replica_prefix(d)
    pool = ReplicaPool(deployment, plan.make, slots, initial, d.autoscaling if d else None, prefix=prefix)
    deployment.queue.set_capacity(initial * slots)
    return pool


def _deployment(plan: DeploymentPlan, config: GatewayConfig) -> Deployment:
    d = plan.spec
    if d is None:
        upstreams = [Upstream(r.url, r.api_key, name=f"{FLAGS_TEXT}-{i}") for i, r in enumerate(plan.replicas)]
        deployment = deployment_for(upstreams, config)
        deployment.response_cache = ResponseCache(config.response_cache, redis_url=config.redis_url) \
            if config.response_cache else None
        return deployment
    deployment = _spec_deployment(plan, config)
    deployment.fallbacks = list(d.fallbacks)
    deployment.degrader = Degrader(d.degradation) if d.degradation else None
    deployment.response_cache = ResponseCache(d.response_cache, redis_url=config.redis_url) if d.response_cache \
        else None
    return deployment


def _spec_deployment(plan: DeploymentPlan, config: GatewayConfig) -> Deployment:
    d = plan.spec
    if d.role == "stable":  # a canary is priced as its name (spec: its price is the stable's or unset)
        config.prices[d.name] = d.price
    queue = d.queue or _default_queue(config, d)
    if d.external is None and not plan.replicas:
        return _unstarted_deployment(d, queue)
    if d.external is None:
        upstreams = [Upstream(r.url, r.api_key, name=f"{replica_prefix(d)}-{i}") for i, r in enumerate(plan.replicas)]
        if d.engine.engine == "inferd":
            first = plan.replicas[0]
            card = first.card() if isinstance(first, InProcessReplica) else None  # no server to ask yet
            return deployment_for(upstreams, config, d.name, queue=queue, router=d.router, version=d.version,
                                  card=card)
        tokenizer = str(source_path(d.kind, d.model.source))  # the model's own tokenizer counts its tokens
        deployment = deployment_for(upstreams, config, d.name, tokenizer, d.runtime.max_model_len, queue, d.router,
                                    d.version, runtime=d.engine.engine)
        deployment.card |= {"source_path": tokenizer, "engine": d.engine.engine}
        return deployment
    e = d.external
    key = os.environ.get(e.api_key_env) if e.api_key_env else None
    if e.api != "openai":  # a provider's own protocol (its models list is not OpenAI's: the card is the spec's)
        transport = {"anthropic": lambda: AnthropicTransport(bearer=e.auth == "bearer"),
                     "azure": lambda: AzureTransport(e.model or d.name, e.api_version),
                     "gemini": GeminiTransport, "bedrock": BedrockTransport}[e.api]()
        upstream = Upstream(e.base_url, key, name=d.name, transport=transport)
        return deployment_for([upstream], config, d.name, e.tokenizer, e.max_model_len, queue, d.router, d.version,
                              runtime=e.api, card={"id": e.model or d.name})
    upstream = Upstream(e.base_url, key, name=d.name)
    deployment = deployment_for([upstream], config, d.name, e.tokenizer, e.max_model_len, queue, d.router, d.version)
    deployment.upstream_model = e.model or d.name
    return deployment


def _default_queue(config: GatewayConfig, d: DeploymentSpec) -> QueueConfig:
    q = config.queue
    inflight = d.replicas * slots_of(d) if d.external is None else q.max_inflight
    return QueueConfig(max(inflight, 1), q.max_queue_len, q.max_queued_tokens)  # the pool sets the live capacity


def slots_of(d: DeploymentSpec) -> int:
    """Requests one replica of the deployment runs at once."""
    if d.engine.engine == "inferd":
        return d.runtime.replica_slots
    from inferd.control.runtimes import replica_slots
    return replica_slots(d.engine.engine, d.runtime)


def _unstarted_deployment(d: DeploymentSpec, queue: QueueConfig) -> Deployment:
    """Scaled to zero from the start: the gateway's model part from the model files; the first replica that
    becomes ready completes the card."""
    model = model_from_files(d.kind, d.model.source, d.runtime)
    return Deployment(name=d.name, model=model, upstreams=[], queue=AdmissionQueue(queue), version=d.version,
                      upstream_model=d.name, router=Router(d.router), runtime=d.engine.engine,
                      internal_headers=d.engine.engine == "inferd")
