"""The model kinds the control plane runs: each kind's settings, its packaged default model, and what the
gateway needs of it (its model part) from a replica's card or from the model files.

The loaders import torch, so they are imported where used: `inferd keys ...` and the parser stay light."""
import functools
from pathlib import Path

from inferd.classical.config import ClassicalConfig
from inferd.embeddings.config import EmbeddingConfig
from inferd.engine.config import EngineConfig
from inferd.gateway.deployments import ClassicalModel, EmbeddingModel, ModelKind, PolicyModel, TextModel
from inferd.policy.config import PolicyConfig
from inferd.protocol.classical import TabularSchema
from inferd.protocol.embeddings import EmbeddingShape
from inferd.protocol.policy import ObservationSpec

SETTINGS: dict[str, type] = {"text": EngineConfig, "embedding": EmbeddingConfig, "classical": ClassicalConfig,
                             "policy": PolicyConfig}
Settings = EngineConfig | EmbeddingConfig | ClassicalConfig | PolicyConfig
KINDS = tuple(SETTINGS)


def default_source(kind: str) -> Path:
    """The kind's packaged model (classical: the demo iris classifier, trained here on first use; policy: the
    demo reacher policy, trained in this project and shipped with it)."""
    from inferd.classical.demo import demo_model_path
    from inferd.models.loader import default_model_path
    from inferd.models.sentence import default_embedding_model_path
    from inferd.policy.demo import demo_policy_path
    return {"text": default_model_path, "embedding": default_embedding_model_path,
            "classical": demo_model_path, "policy": demo_policy_path}[kind]()


def source_path(kind: str, source: str | None) -> Path:
    """A spec's model source ("default" or None: the packaged model of the kind)."""
    return default_source(kind) if source in (None, "default") else Path(source).expanduser()


def gateway_model(card: dict, tokenizer_source: str | None = None, max_model_len: int | None = None) -> ModelKind:
    """The gateway's part of a deployment, from its replica's /v1/models card."""
    source = tokenizer_source or card.get("source_path")
    if card.get("kind") == "embedding":
        shape = EmbeddingShape(card["dimensions"], card["max_input_tokens"], card["num_special_tokens"],
                               bool(card.get("matryoshka")))
        return EmbeddingModel(_embedding_tokenizer(source), shape, bool(card.get("truncate")))
    if card.get("kind") == "classical":
        return ClassicalModel(TabularSchema.from_dict(card["schema"]), card.get("format", ""), card.get("platform", ""))
    if card.get("kind") == "policy":
        return policy_model(card["metadata"], card["max_frame_bytes"], card["max_sessions"], card["idle_timeout_s"])
    return TextModel(_text_tokenizer(source), max_model_len or card.get("max_model_len") or 8192)


def model_from_files(kind: str, source: str | None, settings: Settings) -> ModelKind:
    """The gateway's part of a deployment before any replica answers (scaled to zero), from the model files."""
    path = source_path(kind, source)
    if kind == "policy":
        from inferd.policy.model import load_policy
        files = load_policy(path)
        return policy_model(files.metadata(), settings.max_frame_bytes, settings.max_sessions, settings.idle_timeout_s)
    if kind == "classical":
        from inferd.classical.formats import load_classical_model
        files = load_classical_model(path, settings)
        return ClassicalModel(files.schema, files.format, files.platform)
    if kind == "embedding":
        from inferd.embeddings.runtime import special_tokens
        from inferd.models.sentence import load_embedding_model
        files = load_embedding_model(path)
        before, after = special_tokens(files.tokenizer)
        shape = EmbeddingShape(files.dimensions, files.max_input_tokens, len(before) + len(after), settings.matryoshka)
        return EmbeddingModel(files.tokenizer, shape, settings.truncate)
    return TextModel(_text_tokenizer(path), settings.max_model_len or _context_length(path))


def policy_model(metadata: dict, max_frame_bytes: int, max_sessions: int, idle_timeout_s: float) -> PolicyModel:
    return PolicyModel(metadata, ObservationSpec.from_dict(metadata["observation_spec"]), max_frame_bytes,
                       max_sessions, idle_timeout_s)


@functools.cache  # one per model source, however many deployments serve it
def _text_tokenizer(source):
    from inferd.models.loader import load_tokenizer
    return load_tokenizer(source)


@functools.cache
def _embedding_tokenizer(source):
    from inferd.models.sentence import load_embedding_tokenizer
    return load_embedding_tokenizer(source)


def _context_length(path: Path) -> int:
    if path.is_dir():
        from inferd.models.hf import read_json
        return (read_json(path / "config.json") or {}).get("max_position_embeddings", 2048)
    from gguf import GGUFReader
    from inferd.models.gguf import integer, metadata
    reader = GGUFReader(path)
    return integer(reader, f"{metadata(reader, 'general.architecture')}.context_length", 2048)
