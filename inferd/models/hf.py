import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from inferd.models.config import LoadedModel, ModelConfig
from inferd.models.errors import ModelLoadError
from inferd.models.progress import Progress
from inferd.models.tokenizer import Tokenizer, turn_end_token_ids, unique_ids

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CHUNK_BYTES = 1 << 20


def load_hf_dir(path: Path, progress: bool = True) -> LoadedModel:
    """Read a Hugging Face model directory: config.json, *.safetensors, tokenizer.json and friends."""
    raw = read_json(path / "config.json")
    if raw is None:
        raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    files = safetensors_files(path)
    tokenizer = read_tokenizer(path, raw)
    config = model_config(raw, tokenizer)
    weights = read_weights(files, config.tie_word_embeddings, progress)
    return LoadedModel(name=path.name, path=path, config=config, weights=weights, tokenizer=tokenizer,
                       digests=digests(files, path / "tokenizer.json", tokenizer.chat_template))


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-download the model") from exc


def digests(files: list[Path], tokenizer_file: Path, chat_template: str | None) -> dict[str, str]:
    return {"weights": sha256_files(files), "tokenizer": sha256_files([tokenizer_file]),
            "chat_template": hashlib.sha256((chat_template or "").encode()).hexdigest()}


def sha256_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


# ---- config

def model_config(raw: dict, tokenizer: Tokenizer) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"config.json says model_type {model_type!r}; "
                             f"inferd runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    hidden, heads = required(raw, "hidden_size"), required(raw, "num_attention_heads")
    return ModelConfig(
        vocab_size=required(raw, "vocab_size"), hidden_size=hidden, num_heads=heads,
        intermediate_size=required(raw, "intermediate_size"), num_layers=required(raw, "num_hidden_layers"),
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=rope_theta(raw), rope_scaling=rope_scaling(raw),
        max_position_embeddings=max_positions(raw), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=list(tokenizer.eos_token_ids))


def required(raw: dict, key: str):
    if key not in raw:
        raise ModelLoadError(f"config.json lacks {key!r}; the model directory is incomplete")
    return raw[key]


def rope_theta(raw: dict) -> float:
    return float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def rope_scaling(raw: dict) -> dict | None:
    """HF rope_scaling form from either rope_scaling (transformers 4) or rope_parameters (transformers 5)."""
    given = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    params = {k: v for k, v in given.items() if k != "rope_theta"}
    kind = params.pop("rope_type", params.pop("type", "default"))
    return None if kind == "default" else {"rope_type": kind, **params}


def max_positions(raw: dict) -> int:
    """Context length; capped at the sliding window where one applies, since inferd attends to all positions."""
    positions, window = raw.get("max_position_embeddings", 2048), raw.get("sliding_window")
    uses_window = window is not None and raw.get("use_sliding_window", raw.get("model_type") != "qwen2")
    return min(positions, window) if uses_window else positions


# ---- weights

def safetensors_files(path: Path) -> list[Path]:
    index = read_json(path / "model.safetensors.index.json")
    names = sorted(set(index["weight_map"].values())) if index else sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise ModelLoadError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ModelLoadError(f"{path} lacks weight files {missing}; the download is incomplete")
    return [path / n for n in names]


def read_weights(files: list[Path], tied: bool, progress: bool) -> dict[str, torch.Tensor]:
    weights = {}
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:  # its header only
            total += len(f.keys())
    with Progress("loading tensors", total, "tensor", progress) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if not name.endswith("rotary_emb.inv_freq") and not (tied and name == "lm_head.weight"):
                        weights[name] = f.get_tensor(name).float()
                    bar.update()
    if not tied and "lm_head.weight" not in weights:
        raise ModelLoadError("the weights lack lm_head.weight but config.json says tie_word_embeddings is false")
    return weights


# ---- tokenizer

def read_tokenizer(path: Path, raw: dict) -> Tokenizer:
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json; save one with transformers: "
                             "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    settings = read_json(path / "tokenizer_config.json") or {}
    template = chat_template(path, settings)
    bos = token_id(hf, settings.get("bos_token"), raw.get("bos_token_id"))
    generation = read_json(path / "generation_config.json") or {}
    eos = [token_id(hf, settings.get("eos_token"), None), *as_list(generation.get("eos_token_id")),
           *as_list(raw.get("eos_token_id")), *turn_end_token_ids(hf, template)]
    add_bos = settings.get("add_bos_token")
    return Tokenizer(hf, template, bos, unique_ids(eos),
                     add_bos=add_bos if isinstance(add_bos, bool) else post_processor_adds_bos(hf, bos))


def chat_template(path: Path, settings: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = (read_json(path / "chat_template.json") or {}).get("chat_template") or settings.get("chat_template")
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def token_id(hf: HFTokenizer, token: str | dict | None, fallback: int | list | None) -> int | None:
    text = token.get("content") if isinstance(token, dict) else token
    found = hf.token_to_id(text) if text else None
    return found if found is not None else next(iter(as_list(fallback)), None)


def as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def post_processor_adds_bos(hf: HFTokenizer, bos: int | None) -> bool:
    return bos is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
