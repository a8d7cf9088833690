"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens of one step are flattened to [T, hidden]: every linear runs once over all
of them. Attention reads the paged cache through `AttentionMetadata`: the
decode tokens (one query each) come first and are batched; each prefill chunk
follows and runs on its own.
"""
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from inferd.models.config import ModelConfig
from inferd.models.cpu_kernels import TorchKernels
from inferd.models.decode_loop import LayerPlan, layer_plan
from inferd.models.packed import float_op, gated_op, linear_op


class StepInterrupted(Exception):
    """A forward stopped between layers because its caller asked it to (LlamaForCausalLM.forward's between)."""


class UnsupportedModelError(Exception):
    pass


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the step's tokens
    num_tokens: int  # query tokens in this chunk
    context_blocks: torch.Tensor  # [nb] cache blocks holding the whole context, this chunk included
    context_len: int


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode_tokens: int  # rows [0, D) are decodes, one token each
    block_size: int
    decode_blocks: torch.Tensor | None  # [D, nb] block table of each decode, padded
    decode_lens: torch.Tensor | None  # [D] context length of each decode, this token included
    prefills: list[PrefillChunk]


NO_RESIDUAL = torch.empty(0)  # the C++ loop's residual before the first layer


# ---- rotary embedding

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, scaled, out)


class RotaryEmbedding(nn.Module):
    """RoPE tables: cos and sin of each position's angles, float32 [max_positions, hd/2]. q/k weights are
    loaded with each head's two halves interleaved (see `interleave_halves`), so pairs (x_i, x_{i+d/2}) sit
    side by side and rotate as one complex multiply; the same permutation of q and k leaves q.k unchanged."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        self.cos, self.sin = freqs.cos(), freqs.sin()  # not buffers: module.to(dtype) must not cast them


def interleave_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered from [first half, second half] to pairs (i, i + hd/2)."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return w.view(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


# ---- layers: weight holders; a forward runs them as plain calls (LayerOps), not through nn.Module calls

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


@dataclass(slots=True)
class LayerOps:
    """One decoder layer as plain calls, made from its modules once (LlamaForCausalLM.layer_ops): a forward through
    nn.Module calls spent 1.2-1.5 ms of a 4.8 ms int4 SmolLM2 forward at one sequence in module calls and checks
    (benchmarks/README.md, "A forward without module calls")."""
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gated: Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up of the fused gate_up projection
    down: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    q_size: int
    scale: float
    linears: tuple[nn.Module, ...]  # qkv, o, gate_up, down: what a C++ plan of the layer asks (decode_loop.py)

    @classmethod
    def of(cls, layer: DecoderLayer, dtype: torch.dtype, silu: Callable[[torch.Tensor], torch.Tensor]) -> "LayerOps":
        a, m = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
                   linear_op(a.qkv_proj, dtype), linear_op(a.o_proj, dtype), gated_op(m.gate_up_proj, dtype, silu),
                   linear_op(m.down_proj, dtype), a.num_heads, a.num_kv_heads, a.q_size, a.scale,
                   (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))


def decoder_layer(ops: LayerOps, kernels, h, residual, rope, meta: AttentionMetadata, k_cache, v_cache,
                  profiling: bool):
    """Returns (this layer's MLP output, the residual stream before it): the sum is the layer's output, added by
    the next norm (add_rms_norm) instead of on its own. rope: (cos, sin, positions)."""
    if residual is None:
        residual, x = h, kernels.rms_norm(h, ops.norm_in, ops.eps)
    else:
        x = kernels.add_rms_norm(h, residual, ops.norm_in, ops.eps)
    q = kernels.rope_cache(ops.qkv(x), *rope, k_cache, v_cache, meta.slot_mapping, ops.heads,
                           ops.kv_heads)  # [T, H, hd]; K/V now in the cache
    out = attention(kernels, q, meta, k_cache, v_cache, ops.scale, profiling)
    x = kernels.add_rms_norm(ops.o(out.view(-1, ops.q_size)), residual, ops.norm_post, ops.eps)
    return ops.down(ops.gated(x)), residual


def attention(kernels, q, meta: AttentionMetadata, k_cache, v_cache, scale: float, profiling: bool):
    """The decodes' attention batched, then each prefill chunk's; under the profiler each is named (a
    record_function costs microseconds, 30 a step)."""
    d = meta.num_decode_tokens
    if d and not meta.prefills:
        with _named("inferd::paged_decode_attention", profiling):
            return kernels.paged_decode(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, meta.block_size,
                                        scale)
    out = torch.empty_like(q)
    if d:
        with _named("inferd::paged_decode_attention", profiling):
            out[:d] = kernels.paged_decode(q[:d], k_cache, v_cache, meta.decode_blocks, meta.decode_lens,
                                           meta.block_size, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        with _named("inferd::prefill_attention", profiling):
            out[rows] = kernels.prefill_attention(q[rows], k_cache, v_cache, chunk.context_blocks, chunk.context_len,
                                                  meta.block_size, scale)
    return out


def _named(name: str, profiling: bool):
    return record_function(name) if profiling else nullcontext()


# ---- model

class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config, max_positions)
        self.kernels = TorchKernels  # the ops of inferd.models.cpu_kernels the layers run on (use_kernels)
        self._plan: tuple[list[LayerOps], Callable[[torch.Tensor], torch.Tensor]] | None = None  # layers, lm_head
        self._caches: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._loops: dict[int, LayerPlan | None] = {}  # decode rows -> the layers as one C++ call, or None

    def use_kernels(self, kernels) -> None:
        """Runs norms, RoPE, cache writes, attention and silu on `kernels` (inferd.models.cpu_kernels)."""
        self.kernels = kernels
        self.replan()

    def layer_ops(self) -> list[LayerOps]:
        """The layers as plain calls, made on first use: after the weights are loaded, cast, quantized and packed."""
        return self._planned()[0]

    def _planned(self) -> tuple[list[LayerOps], Callable[[torch.Tensor], torch.Tensor]]:
        if self._plan is None:
            dtype = self.embed_tokens.weight.dtype  # the activations'
            silu = self.kernels.silu_mul
            self._plan = [LayerOps.of(layer, dtype, silu) for layer in self.layers], float_op(self.lm_head, dtype)
        return self._plan

    def replan(self) -> None:
        """Forgets the layers' and lm_head's ops: call it after replacing a module once the model has run."""
        self._plan, self._loops = None, {}

    def _loop(self, meta: AttentionMetadata, rows: int) -> LayerPlan | None:
        """The C++ plan of the layers for a step of `rows` decode tokens and nothing else, where there is one."""
        if meta.prefills or meta.num_decode_tokens != rows:
            return None
        if rows not in self._loops:
            self._loops[rows] = layer_plan(self._planned()[0], self.kernels, rows, self.embed_tokens.weight.dtype)
        return self._loops[rows]

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: torch.Tensor,
                logits_indices: torch.Tensor, between: Callable[[], None] | None = None) -> torch.Tensor:
        """kv_cache: [layers, 2, slots, kv_heads, head_dim]. Returns fp32 logits of the rows asked for.
        between: called before each layer. It may raise StepInterrupted to end this forward (the K/V it wrote
        are for positions not yet counted as computed: a later forward writes them again), or run a forward of
        its own over other slots of the cache before this one goes on."""
        h, residual = self.embed_tokens(input_ids), None
        rope, kernels, profiling = (self.rope.cos, self.rope.sin, positions), self.kernels, torch.autograd._profiler_enabled()
        layers, head = self._planned()
        loop = None if profiling else self._loop(meta, input_ids.shape[0])  # a profile names each op: Python's
        if loop is not None:
            step = (*rope, meta.slot_mapping, kv_cache, meta.decode_blocks, meta.decode_lens, meta.block_size)
            if between is None:
                h, residual = loop.run(0, len(layers), h, NO_RESIDUAL, *step)
            else:
                residual = NO_RESIDUAL
                for i in range(len(layers)):
                    between()
                    h, residual = loop.run(i, i + 1, h, residual, *step)
        else:
            for ops, (k_cache, v_cache) in zip(layers, self._layer_caches(kv_cache)):
                if between is not None:
                    between()
                h, residual = decoder_layer(ops, kernels, h, residual, rope, meta, k_cache, v_cache, profiling)
        h = kernels.add_rms_norm(h[logits_indices], residual[logits_indices], self.norm.weight, self.norm.eps)
        return head(h)

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views of kv_cache, made once per cache tensor."""
        if self._caches is None or self._caches[0] is not kv_cache:
            self._caches = (kv_cache, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(len(self.layers))])
        return self._caches[1]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Takes Hugging Face names; fuses q/k/v and gate/up."""
        params = dict(self.named_parameters())
        for name, tensor in _fused(weights, self.config):
            name = name.removeprefix("model.")
            if name not in params:
                raise UnsupportedModelError(f"unexpected weight {name!r}")
            if params[name].shape != tensor.shape:
                raise UnsupportedModelError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)


def _fused(weights: dict[str, torch.Tensor], config: ModelConfig):
    weights = dict(weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = (weights.pop(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
            q, k = interleave_halves(q, config.head_dim), interleave_halves(k, config.head_dim)
            yield f"{p}self_attn.qkv_proj.{kind}", torch.cat([q, k, v])
        yield f"{p}mlp.gate_up_proj.weight", torch.cat([weights.pop(f"{p}mlp.gate_proj.weight"),
                                                         weights.pop(f"{p}mlp.up_proj.weight")])
    yield from weights.items()
