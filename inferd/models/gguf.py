import hashlib
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from tokenizers import Tokenizer as HFTokenizer

from inferd.models import gguf_cache
from inferd.models.config import LoadedModel, ModelConfig
from inferd.models.errors import ModelLoadError
from inferd.models.progress import Progress
from inferd.models.tokenizer import (
    LLAMA3_PRE,
    Tokenizer,
    add_vocab_special_tokens,
    byte_level_bpe,
    sentencepiece_bpe,
    turn_end_token_ids,
    unique_ids,
)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
PERMUTED_ARCHS = ("llama", "mistral")
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
QUANT_TAG = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


class PlainArrayReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap: parsing 50k-token vocabularies gets ~3x faster."""

    @property
    def data(self) -> np.ndarray:
        return self.plain_data

    @data.setter
    def data(self, value: np.memmap) -> None:
        self.plain_data = value.view(np.ndarray)


def load_gguf(path: Path, progress: bool = True) -> LoadedModel:
    """Read a GGUF file: config from metadata, float32 weights under Hugging Face names, tokenizer.

    What it produces is cached per file digest (inferd.models.gguf_cache): later loads skip the parsing."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    cached = gguf_cache.read(digest)
    if cached is not None:
        config, weights, tokenizer = cached
    else:
        config, weights, tokenizer = read_gguf(path, progress)
        gguf_cache.write(digest, config, weights, tokenizer)
    return LoadedModel(name=model_name(path), path=path, config=config, weights=weights, tokenizer=tokenizer,
                       digests=digests(digest, tokenizer))


def read_gguf(path: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    try:
        reader = PlainArrayReader(path)
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = str(required(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path.name} is a {arch!r} model; inferd runs {', '.join(SUPPORTED_ARCHS)}")
    tokenizer = read_tokenizer(reader)
    config = read_config(reader, arch, tokenizer)
    weights = read_weights(reader, config, arch, progress)
    check_vocab_size(config, weights)
    return config, weights, tokenizer


def model_name(path: Path) -> str:
    return QUANT_TAG.sub("", path.stem)


def digests(weights: str, tokenizer: Tokenizer) -> dict[str, str]:
    return {"weights": weights, "tokenizer": sha256_text(tokenizer.hf_tokenizer.to_str()),
            "chat_template": sha256_text(tokenizer.chat_template or "")}


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_vocab_size(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    rows = weights["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in weights else None
    if rows != config.vocab_size:
        raise ModelLoadError(f"the GGUF lists {config.vocab_size} tokens but its token_embd has {rows} rows; "
                             "the file is inconsistent, re-convert it")

# ---- metadata

def metadata(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def required(reader: gguf.GGUFReader, key: str):
    value = metadata(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key}; the file is incomplete or not a model file")
    return value


def integer(reader: gguf.GGUFReader, key: str, default: int | None = None) -> int:
    value = required(reader, key) if default is None else metadata(reader, key, default)
    if not isinstance(value, int):
        raise ModelLoadError(f"GGUF metadata {key} is {value!r}; inferd needs one integer (same for every layer)")
    return value


def f32_decimal(value: float) -> float:
    return float(str(np.float32(value)))


# ---- config

def read_config(reader: gguf.GGUFReader, arch: str, tokenizer: Tokenizer) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    hidden, heads = integer(reader, f"{arch}.embedding_length"), integer(reader, f"{arch}.attention.head_count")
    head_dim = (metadata(reader, f"{arch}.attention.key_length") or metadata(reader, f"{arch}.rope.dimension_count")
                or hidden // heads)
    theta = f32_decimal(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    return ModelConfig(
        vocab_size=len(required(reader, "tokenizer.ggml.tokens")), hidden_size=hidden,
        intermediate_size=integer(reader, f"{arch}.feed_forward_length"),
        num_layers=integer(reader, f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=integer(reader, f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=f32_decimal(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta, rope_scaling=rope_scaling(reader, arch, theta, head_dim),
        max_position_embeddings=integer(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names, attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=list(tokenizer.eos_token_ids))


def rope_scaling(reader: gguf.GGUFReader, arch: str, theta: float, head_dim: int) -> dict | None:
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return llama3_rope_scaling(dequantize(freqs).numpy(), theta, head_dim)
    factor = metadata(reader, f"{arch}.rope.scaling.factor") or metadata(reader, f"{arch}.rope.scale_linear")
    kind = metadata(reader, f"{arch}.rope.scaling.type", "linear" if factor else "none")
    if kind == "none" or not factor:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = integer(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    raise ModelLoadError(f"rope scaling {kind!r} is not supported; inferd knows linear, yarn and llama3")


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Recover Llama 3 rope scaling from the per-frequency factors llama.cpp stores in rope_freqs."""
    guess = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = llama3_factors(guess, theta, head_dim)
    if factors.shape != expected.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ModelLoadError("this GGUF's rope_freqs tensor is not standard Llama 3 rope scaling; "
                             "load the model's Hugging Face directory instead")
    return guess


def llama3_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (context / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    factors = np.where(wavelengths < context / high, 1.0, blended)
    return np.where(wavelengths > context / low, scaling["factor"], factors)


# ---- weights

def read_weights(reader: gguf.GGUFReader, config: ModelConfig, arch: str, progress: bool) -> dict[str, torch.Tensor]:
    weights = {}
    with Progress("loading tensors", len(reader.tensors), "tensor", progress) as bar:
        for tensor in reader.tensors:
            bar.update()
            if tensor.name == "rope_freqs.weight":
                continue
            name, value = hf_name(tensor.name), dequantize(tensor)
            weights[name] = unpermute_qk(name, value, config) if arch in PERMUTED_ARCHS else value
    return weights


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r}; inferd knows Llama-family decoder tensors only")


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """float32 copy in numpy/Hugging Face order: [out_features, in_features]."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"tensor {tensor.name} is {tensor.tensor_type.name}, which inferd cannot dequantize; "
                             "use a file quantized as F16, BF16, Q8_0, Q4_K_M or similar") from exc
    values = np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def unpermute_qk(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if ".q_proj." in name:
        return unpermute(weight, config.num_heads)
    return unpermute(weight, config.num_kv_heads) if ".k_proj." in name else weight


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rope permutation of q/k rows (back to rotate-half)."""
    rows = weight.shape[0]
    halves = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape).contiguous()


# ---- tokenizer

def read_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer llama.cpp would run, rebuilt from tokenizer.ggml.* metadata."""
    kind, pre = metadata(reader, "tokenizer.ggml.model"), metadata(reader, "tokenizer.ggml.pre", "default")
    hf = vocabulary(reader, kind, pre)
    types = metadata(reader, "tokenizer.ggml.token_type", [])
    add_vocab_special_tokens(hf, required(reader, "tokenizer.ggml.tokens"), types)
    template = metadata(reader, "tokenizer.chat_template")
    stops = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama" or pre in LLAMA3_PRE)
    return Tokenizer(hf, template, metadata(reader, "tokenizer.ggml.bos_token_id"),
                     unique_ids(stops + turn_end_token_ids(hf, template)), add_bos=bool(add_bos))


def vocabulary(reader: gguf.GGUFReader, kind: str | None, pre: str) -> HFTokenizer:
    tokens = required(reader, "tokenizer.ggml.tokens")
    if kind == "gpt2":
        return byte_level_bpe(tokens, required(reader, "tokenizer.ggml.merges"), pre)
    if kind == "llama":
        unk = metadata(reader, "tokenizer.ggml.unknown_token_id")
        prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
        scores = required(reader, "tokenizer.ggml.scores")
        return sentencepiece_bpe(tokens, scores, None if unk is None else tokens[unk], prefix)
    raise ModelLoadError(f"GGUF tokenizer {kind!r} is not supported; "
                         "load the model's Hugging Face directory instead")
