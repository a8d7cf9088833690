"""BERT-family encoder (BertModel as sentence-transformers directories hold it) and the pooling after it.

A batch is [B, L] token ids padded on the right with a [B, L] mask of real tokens; attention masks the
padded keys. The output is the last hidden state [B, L, hidden]; `pool` turns it into [B, hidden].
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens", "lasttoken")
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self):
        assert self.hidden_size % self.num_heads == 0
        assert self.hidden_act in ACTIVATIONS, self.hidden_act

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.act = c.num_heads, c.head_dim, ACTIVATIONS[c.hidden_act]
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.attn_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.out_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, n, d)))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        c = self.config = config
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_layers))

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, mask: [B, L] (mask true on real tokens) -> hidden states [B, L, hidden]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        key_mask = mask[:, None, None, :]  # [B, 1, 1, L]: every query sees the real keys of its row
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


# weights: Hugging Face BertModel names -> ours

def load_weights(model: BertEncoder, weights: dict[str, torch.Tensor]) -> None:
    """Copy a BertModel state dict (optionally prefixed `bert.`) into model; raises KeyError naming what lacks."""
    w = {k.removeprefix("bert."): v for k, v in weights.items()}
    ours = {"word_embeddings.weight": w["embeddings.word_embeddings.weight"],
            "position_embeddings.weight": w["embeddings.position_embeddings.weight"],
            "token_type_embeddings.weight": w["embeddings.token_type_embeddings.weight"],
            **_norm("embed_norm", w, "embeddings.LayerNorm")}
    for i in range(model.config.num_layers):
        ours |= _layer(f"layers.{i}.", w, f"encoder.layer.{i}.")
    model.load_state_dict(ours, strict=True)


def _layer(ours: str, w: dict[str, torch.Tensor], hf: str) -> dict[str, torch.Tensor]:
    qkv = [f"{hf}attention.self.{name}" for name in ("query", "key", "value")]
    return {f"{ours}qkv.weight": torch.cat([w[f"{n}.weight"] for n in qkv]),
            f"{ours}qkv.bias": torch.cat([w[f"{n}.bias"] for n in qkv]),
            **_linear(f"{ours}attn_out", w, f"{hf}attention.output.dense"),
            **_norm(f"{ours}attn_norm", w, f"{hf}attention.output.LayerNorm"),
            **_linear(f"{ours}up", w, f"{hf}intermediate.dense"),
            **_linear(f"{ours}down", w, f"{hf}output.dense"),
            **_norm(f"{ours}out_norm", w, f"{hf}output.LayerNorm")}


def _linear(ours: str, w: dict[str, torch.Tensor], hf: str) -> dict[str, torch.Tensor]:
    return {f"{ours}.weight": w[f"{hf}.weight"], f"{ours}.bias": w[f"{hf}.bias"]}


def _norm(ours: str, w: dict[str, torch.Tensor], hf: str) -> dict[str, torch.Tensor]:
    weight = w.get(f"{hf}.weight", w.get(f"{hf}.gamma"))  # old checkpoints say gamma/beta
    bias = w.get(f"{hf}.bias", w.get(f"{hf}.beta"))
    if weight is None or bias is None:
        raise KeyError(f"{hf}.weight")
    return {f"{ours}.weight": weight, f"{ours}.bias": bias}


# pooling: [B, L, hidden] -> [B, hidden], as sentence-transformers' Pooling module computes it

def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pooled in float32, whatever the hidden states' dtype."""
    hidden = hidden.float()
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    m = mask.unsqueeze(-1)
    if mode == "max":
        return hidden.masked_fill(~m, -1e9).amax(1)
    total, count = (hidden * m).sum(1), m.sum(1).to(hidden.dtype).clamp(min=1e-9)
    if mode == "mean":
        return total / count
    assert mode == "mean_sqrt_len_tokens", mode
    return total / count.sqrt()
