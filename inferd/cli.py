import argparse
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

from inferd.bench.cli import add_bench_parser
from inferd.control import commands as gateway_cli
from inferd.control.commands import CommandError
from inferd.control.kinds import KINDS, SETTINGS
from inferd.eval.cli import add_eval_parser
from inferd.engine.config import EngineConfig
from inferd.models.errors import ModelLoadError
from inferd.settings import add_flags, config_from
from inferd.telemetry.logs import LOG_FORMATS

log = logging.getLogger("inferd")

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


# parser

MODEL_HELP = {"text": "a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)",
              "embedding": "a sentence-transformers directory or a .zip of one (default: all-MiniLM-L6-v2)",
              "classical": "a .onnx, XGBoost .json/.ubj, LightGBM .txt or scikit-learn .skops file (default: the "
                           "demo iris classifier, trained on first use)",
              "policy": "a policy directory (config.json + model.safetensors; default: the demo reacher policy)"}


def _replica_flags(p: argparse.ArgumentParser, kind: str = "text") -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP[kind])
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's)")
    add_flags(p, SETTINGS[kind])


def _listen_flags(p: argparse.ArgumentParser, key_help: str) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("INFERD_API_KEY"), help=key_help)
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _parser(replica_kind: str = "text") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="Self-hosted LLM inference, OpenAI-compatible.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="the gateway in front of local replica processes of one model")
    _replica_flags(serve)
    _listen_flags(serve, "register this key (hashed) for tenant 'default' ($INFERD_API_KEY)")
    serve.add_argument("--replicas", type=int, default=1, help="local replica processes (default 1)")
    serve.add_argument("--config", default=None, help="a deployment spec (YAML): its deployments replace MODEL and "
                       "the engine flags")
    serve.add_argument("--embedding-model", default="default", metavar="PATH|default|none",
                       help="also serve this embedding model, as its own deployment (default: the packaged "
                       "all-MiniLM-L6-v2; none: no embeddings)")
    serve.add_argument("--classical-model", default="default", metavar="PATH|default|none",
                       help="also serve this classical (tabular) model, as its own deployment (default: the demo "
                       "iris-classifier, trained on first start; none: no classical model)")
    serve.add_argument("--policy-model", default="default", metavar="PATH|default|none",
                       help="also serve this robot policy over WebSocket at /v1/policies/NAME/ws (default: the "
                       "demo reacher policy; none: no policy)")
    gateway_cli.add_gateway_flags(serve)
    replica = commands.add_parser("replica", help="one replica of a model kind behind the OpenAI API, no tenants")
    replica.add_argument("--kind", choices=KINDS, default="text", help="text: our engine (chat, completions); "
                         "embedding: /v1/embeddings; classical: /v1/predict and /v2; policy: /v1/policy/infer (the flags below are the kind's: see --kind "
                         "K --help)")
    _replica_flags(replica, replica_kind)
    _listen_flags(replica, "require 'Authorization: Bearer KEY' on /v1/* and /v2/* ($INFERD_API_KEY)")
    replica.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    gateway = commands.add_parser("gateway", help="the gateway alone, in front of OpenAI-compatible upstreams")
    gateway.add_argument("--upstream", action="append", required=True, help="base URL of a replica (repeatable)")
    gateway.add_argument("--upstream-api-key", default=os.environ.get("INFERD_UPSTREAM_API_KEY"))
    gateway.add_argument("--model", default=None, help="the model name clients use (default: the upstream's)")
    gateway.add_argument("--tokenizer", default=None, help="a .gguf or model directory to count tokens with "
                         "(default: the upstream's source_path, else the default model's)")
    gateway.add_argument("--max-model-len", type=int, default=None)
    _listen_flags(gateway, "register this key (hashed) for tenant 'default' ($INFERD_API_KEY)")
    gateway_cli.add_gateway_flags(gateway)
    config = commands.add_parser("config", help="deployment specs").add_subparsers(dest="action", required=True)
    check = config.add_parser("check", help="validate a deployment spec (fields, settings, model digests)")
    check.add_argument("file")
    policy = commands.add_parser("policy", help="robot policies").add_subparsers(dest="action", required=True)
    train = policy.add_parser("train-demo", help="collect expert demonstrations in the simulator (gymnasium's "
                              "MuJoCo Reacher), behaviour-clone an action-chunking policy and measure its success")
    train.add_argument("--out", required=True, help="the policy directory to write (config.json, model.safetensors, "
                       "training.json)")
    train.add_argument("--episodes", type=int, default=None, help="expert demonstrations (default: the demo's)")
    train.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo's)")
    train.add_argument("--seed", type=int, default=0)
    add_bench_parser(commands)
    add_eval_parser(commands)
    gateway_cli.add_parsers(commands)
    gateway_cli.add_rollout_parser(commands)
    return parser


@contextmanager
def _arguments_checked():
    """A bad argument value raised in the block (ValueError, a file that cannot be read, a model that is not
    there) becomes the command's one-line error: main prints it, exit code 2. Nothing is changed before it."""
    try:
        yield
    except (ValueError, OSError, ModelLoadError) as exc:
        raise CommandError(str(exc)) from None


def _check_sources(args: argparse.Namespace) -> None:
    """The model files `inferd serve` was given exist (the packaged defaults are found when a replica starts)."""
    for flag, source in (("MODEL", args.model), ("--embedding-model", args.embedding_model),
                         ("--classical-model", args.classical_model), ("--policy-model", args.policy_model)):
        if source not in (None, "default", "none") and not os.path.exists(os.path.expanduser(source)):
            raise ValueError(f"{flag}: {source} does not exist")


def _log_flags(args: argparse.Namespace) -> list[str]:
    """How `inferd serve` logs, passed to the replicas it starts: one format across the processes."""
    return ["--log-level", args.log_level, "--log-format", args.log_format]


# commands

def _replica(args: argparse.Namespace) -> int:
    from inferd.engine.async_engine import AsyncEngine
    from inferd.engine.engine import LLMEngine
    from inferd.models.llama import UnsupportedModelError
    from inferd.models.loader import load_model
    from inferd.replica.loading import in_passing_thread
    from inferd.replica.server import ReplicaConfig, build_replica_app, serve

    with _arguments_checked():
        engine_config = config_from(EngineConfig, args)
    model = in_passing_thread(lambda: load_model(args.model, progress=True))
    try:  # built there too: it allocates the KV cache and packs the weights
        engine = AsyncEngine(in_passing_thread(lambda: LLMEngine(model, engine_config)))
    except (ValueError, UnsupportedModelError) as exc:
        raise CommandError(str(exc)) from None
    config = ReplicaConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                           served_model_name=args.served_model_name, log_level=args.log_level,
                           loaded_unix_s=time.time())
    log.info("serving %s from %s (api key %s)", config.served_model_name or model.name, model.path,
             "required" if config.api_key else "not required")
    log.info("model sha256: %s", " ".join(f"{k}={v}" for k, v in model.digests.items()))
    serve(build_replica_app(engine, model, config), config)
    return 0


def _replica_kind(argv: list[str]) -> str:
    """`inferd replica --kind K`: the kind whose settings are the replica's flags."""
    if not argv or argv[0] != "replica":
        return "text"
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--kind=") else argv[i + 1] if arg == "--kind" and \
            i + 1 < len(argv) else None
        if value in KINDS:
            return value
    return "text"


def _batched_replica(args: argparse.Namespace) -> int:
    """A replica of a kind that runs over the batcher (embedding, classical, policy): its settings, then its server."""
    with _arguments_checked():
        config = config_from(SETTINGS[args.kind], args)
    if args.kind == "embedding":
        from inferd.embeddings.server import serve_embeddings as serve
    elif args.kind == "policy":
        from inferd.policy.server import serve_policy as serve
    else:
        from inferd.classical.server import serve_classical as serve
    serve(args.model, args.host, args.port, args.api_key or None, args.served_model_name, config, args.log_level)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The gateway on --port, in front of local `inferd replica` processes (one model, or a --config spec)."""
    from inferd.control.launch import (FLAGS_TEXT, classical_spec, cpu_shares, embedding_spec, local_plans,
                                       policy_spec, replica_args, spec_plans, start_deployments, stop_all)
    from inferd.control.quality import release_gate
    from inferd.control.rollout import controller_for
    from inferd.control.gateway_setup import gateway_config, open_store, run_gateway
    from inferd.control.spec import ServiceSpec, SpecError, load_spec
    from inferd.gateway.keys import imported_key
    from inferd.gateway.transport import UpstreamTransport

    transport = UpstreamTransport()  # the gateway's; in-process replicas are mounted on it
    with _arguments_checked():  # every flag is checked before the store is touched: a bad one changes nothing
        if args.config and args.model:
            raise ValueError("give MODEL (and engine flags) or --config, not both")
        if args.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, not {args.replicas}")
        if args.config:
            try:
                spec = load_spec(args.config)
            except SpecError as exc:
                raise ValueError(f"{args.config}: {exc}") from None
            shares, shown = cpu_shares(spec.deployments)
            plans = spec_plans(spec, _log_flags(args), shares.deployments, transport)
        else:
            _check_sources(args)
            engine = config_from(EngineConfig, args)
            spec = ServiceSpec([make(source) for make, source in ((embedding_spec, args.embedding_model),
                                                                  (classical_spec, args.classical_model),
                                                                  (policy_spec, args.policy_model))
                                if source != "none"])
            shares, shown = cpu_shares(spec.deployments, flags_text=True)
            plans = local_plans(args, replica_args(args.model, args.served_model_name, engine, _log_flags(args)),
                                shares.deployments[FLAGS_TEXT]) + spec_plans(spec, _log_flags(args),
                                                                             shares.deployments, transport)
        config = gateway_config(args, default_inflight=args.replicas * args.max_num_seqs)
        api_key = imported_key(args.api_key) if args.api_key else None
        if shares.gateway is not None:  # its own share; each replica sets its own as it starts (replicas.in_child)
            os.sched_setaffinity(0, shares.gateway)
        store = open_store(config, api_key)  # the first write, once every flag passed (or --db is unusable)
    log.info(shown)
    try:
        deployments = start_deployments(plans, config)  # then each local deployment's pool keeps its replicas
        gate = release_gate(plans, deployments)  # a version below its quality floor takes no traffic
        rollouts = controller_for(plans, deployments, gate)  # canaries: judged, promoted or rolled back
        run_gateway(config, store, deployments, args.log_level,
                    services=[p.pool for p in plans if p.pool is not None] + ([rollouts] if rollouts else []),
                    transport=transport)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 2
    finally:
        stop_all(plans)
    return 0


def _config(args: argparse.Namespace) -> int:
    from inferd.control.spec import SpecError, load_spec
    try:
        spec = load_spec(args.file)
    except SpecError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    kinds = [f"{d.name} ({'external' if d.external else f'{d.replicas} replica(s)'})" for d in spec.deployments]
    print(f"{args.file}: ok: {', '.join(kinds)}")
    return 0


def _train_demo(args: argparse.Namespace) -> int:
    from inferd.policy.train import train_demo
    sizes = {k: v for k, v in (("episodes", args.episodes), ("epochs", args.epochs)) if v is not None}
    figures = train_demo(args.out, seed=args.seed, progress=True, **sizes)
    print(json.dumps(figures, indent=2))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from inferd.gateway.deployments import Deployments, Upstream
    from inferd.control.gateway_setup import deployment_for, gateway_config, open_store, run_gateway
    from inferd.gateway.keys import imported_key

    with _arguments_checked():
        config = gateway_config(args, default_inflight=64)
        api_key = imported_key(args.api_key) if args.api_key else None
        store = open_store(config, api_key)  # the first write, once every flag passed (or --db is unusable)
    upstreams = [Upstream(u, args.upstream_api_key, name=f"upstream-{i}") for i, u in enumerate(args.upstream)]
    deployments = Deployments()
    try:
        deployments.add(deployment_for(upstreams, config, args.model, args.tokenizer, args.max_model_len))
    except RuntimeError as exc:  # the upstream does not answer
        raise CommandError(str(exc)) from None
    run_gateway(config, store, deployments, args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(_replica_kind(argv)).parse_args(argv)
    from inferd.telemetry.logs import setup_logging
    setup_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        _check_kernel_cap()
        return _run(args)
    except CommandError as exc:  # argparse's convention: one line on stderr, exit code 2
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"inferd {args.command}: error: {message}", file=sys.stderr)
        return 2


def _check_kernel_cap() -> None:
    """INFERD_KERNEL_ISA names a variant of the kernels (docs/kernels.md), or the command stops here, in one line."""
    from inferd.kernels.variants import isa_cap
    try:
        isa_cap()
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from inferd.bench.cli import run_bench
        return run_bench(args)
    if args.command == "eval":
        from inferd.eval.cli import run_eval
        return run_eval(args)
    if args.command in ("keys", "tenants", "usage", "console"):
        return gateway_cli.run(args)
    if args.command == "config":
        return _config(args)
    if args.command == "rollout":
        return gateway_cli.rollout(args)
    if args.command == "policy":
        return _train_demo(args)
    try:
        if args.command == "replica" and args.kind != "text":
            return _batched_replica(args)
        return {"serve": _serve, "replica": _replica, "gateway": _gateway}[args.command](args)
    except ModelLoadError as exc:
        log.error("cannot load the model: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
