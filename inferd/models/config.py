from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inferd.models.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF config.json form: {"rope_type": "llama3"|"linear"|..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0


@dataclass(slots=True)
class LoadedModel:
    """Everything read from a model source, before the engine builds on it.

    weights use Hugging Face names (model.embed_tokens.weight,
    model.layers.{i}.self_attn.q_proj.weight, ..., lm_head.weight when untied),
    float32, q/k in the Hugging Face (rotate-half) layout.
    """
    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: "Tokenizer"
    digests: dict[str, str]  # sha256 hex of "weights", "tokenizer", "chat_template"
