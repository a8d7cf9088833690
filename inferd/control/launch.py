"""From a deployment spec (or `inferd serve` flags) to running replicas and the gateway's deployments."""
import argparse
import os
from dataclasses import dataclass, field

from inferd.control.placement import make_replica
from inferd.control.replicas import ReplicaProcess
from inferd.control.spec import DeploymentSpec, ServiceSpec
from inferd.gateway.admission import QueueConfig
from inferd.gateway.config import GatewayConfig
from inferd.gateway.deployments import Deployment, Deployments, Upstream
from inferd.gateway.launch import deployment_for


@dataclass(slots=True)
class DeploymentPlan:
    spec: DeploymentSpec | None  # None: one deployment from `inferd serve` flags
    replicas: list[ReplicaProcess] = field(default_factory=list)


def local_plans(args: argparse.Namespace, replica_args: list[str]) -> list[DeploymentPlan]:
    return [DeploymentPlan(None, [ReplicaProcess(replica_args) for _ in range(args.replicas)])]


def spec_plans(spec: ServiceSpec) -> list[DeploymentPlan]:
    return [DeploymentPlan(d, [make_replica(d.placement, replica_args(d)) for _ in range(d.replicas)] if d.model else [])
            for d in spec.deployments]


def replica_args(d: DeploymentSpec) -> list[str]:
    r = d.runtime
    out = [] if d.model.source == "default" else [d.model.source]
    out += ["--served-model-name", d.name, "--dtype", r.dtype, "--max-num-seqs", str(r.max_num_seqs),
            "--max-num-batched-tokens", str(r.max_num_batched_tokens), "--kv-cache-gib", str(r.kv_cache_gib)]
    for name in ("max_model_len", "num_threads"):
        if getattr(r, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(r, name))]
    return out + ([] if r.enable_prefix_caching else ["--no-prefix-caching"])


def start_deployments(plans: list[DeploymentPlan], config: GatewayConfig) -> Deployments:
    """Starts every local replica, waits until each has run a real inference, then builds the deployments."""
    for plan in plans:
        for r in plan.replicas:
            r.start()
    for plan in plans:
        for r in plan.replicas:
            r.wait_ready()
    deployments = Deployments()
    for plan in plans:
        deployments.add(_deployment(plan, config))
    return deployments


def _deployment(plan: DeploymentPlan, config: GatewayConfig) -> Deployment:
    d = plan.spec
    if d is None:
        upstreams = [Upstream(r.url, r.api_key, name=f"replica-{i}") for i, r in enumerate(plan.replicas)]
        return deployment_for(upstreams, config)
    config.prices[d.name] = d.price
    queue = d.queue or _default_queue(config, d)
    if d.external is None:
        upstreams = [Upstream(r.url, r.api_key, name=f"{d.name}-{i}") for i, r in enumerate(plan.replicas)]
        return deployment_for(upstreams, config, d.name, queue=queue, router=d.router, version=d.version)
    e = d.external
    upstream = Upstream(e.base_url, os.environ.get(e.api_key_env) if e.api_key_env else None, name=d.name)
    deployment = deployment_for([upstream], config, d.name, e.tokenizer, e.max_model_len, queue, d.router, d.version)
    deployment.upstream_model = e.model or d.name
    return deployment


def _default_queue(config: GatewayConfig, d: DeploymentSpec) -> QueueConfig:
    q = config.queue
    inflight = d.replicas * d.runtime.max_num_seqs if d.external is None else q.max_inflight
    return QueueConfig(inflight, q.max_queue_len, q.max_queued_tokens)
