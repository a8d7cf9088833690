import argparse
import logging
import os
import sys

from inferd.bench.cli import add_bench_parser
from inferd.engine.config import EngineConfig

log = logging.getLogger("inferd")

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
DEFAULTS = EngineConfig()


# parser

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="Self-hosted LLM inference, OpenAI-compatible.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve one model over the OpenAI API")
    serve.add_argument("model", nargs="?", default=None,
                       help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("INFERD_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $INFERD_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's)")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    serve.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs)
    serve.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS.max_num_batched_tokens)
    serve.add_argument("--kv-cache-gib", type=float, default=DEFAULTS.kv_cache_gib)
    serve.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-gib")
    serve.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    serve.add_argument("--num-threads", type=int, default=None,
                       help="torch threads for the engine (default: all cores)")
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="never reuse the KV of earlier prompts (default: reuse within a cache namespace)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_bench_parser(commands)
    return parser


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
                            num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                            num_threads=args.num_threads, enable_prefix_caching=args.enable_prefix_caching)
    except ValueError as exc:
        raise SystemExit(f"inferd serve: error: {exc}")


# commands

def _serve(args: argparse.Namespace) -> int:
    from inferd.engine.async_engine import AsyncEngine
    from inferd.engine.engine import LLMEngine
    from inferd.models.llama import UnsupportedModelError
    from inferd.models.loader import load_model
    from inferd.replica.server import ReplicaConfig, build_replica_app, serve

    engine_config = _engine_config(args)
    model = load_model(args.model, progress=True)
    try:
        engine = AsyncEngine(LLMEngine(model, engine_config))
    except (ValueError, UnsupportedModelError) as exc:
        raise SystemExit(f"inferd serve: error: {exc}")
    config = ReplicaConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                           served_model_name=args.served_model_name, log_level=args.log_level)
    log.info("serving %s from %s (api key %s)", config.served_model_name or model.name, model.path,
             "required" if config.api_key else "not required")
    log.info("model sha256: %s", " ".join(f"{k}={v}" for k, v in model.digests.items()))
    serve(build_replica_app(engine, model, config), config)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        from inferd.bench.cli import run_bench
        return run_bench(args)
    from inferd.models.errors import ModelLoadError
    try:
        return _serve(args)
    except ModelLoadError as exc:
        log.error("cannot load the model: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
