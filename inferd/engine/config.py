from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineConfig:
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 where the CPU has native bf16 matmul, else fp32)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # chunked prefill: see benchmarks/chunked_prefill.py
    kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gib when set
    block_size: int = 16
    max_model_len: int | None = None  # defaults to the model's context length
    pack_weights: bool = True  # prepack linear weights for oneDNN where the CPU supports the dtype
    quantization: str = "none"  # none | int8 (weight-only, per output channel; fp32 activations)
    paged_attention_kernel: bool = True  # fp32 decode attention in C++, built on first use (torch path if not)
    num_threads: int | None = None  # torch threads for the engine; default: all cores
    num_speculative_tokens: int = 0  # drafts verified per step (0: off; see benchmarks/spec_decode.py)
    speculative_model: str | None = None  # drafts by: None prompt lookup; a .gguf/HF dir of the same tokenizer;
    # "layers:N" the model's own first N layers (engine/draft.py)
    scheduling_policy: str = "priority"  # fcfs | priority (the gateway's class; lower classes preempted first)
    enable_prefix_caching: bool = True  # reuse the KV of full prompt blocks seen before in the same namespace
    public_prefixes: list[list[int]] = field(default_factory=list)  # token ids (system prompts) all namespaces share

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be none or int8; got {self.quantization!r}")
        if self.kv_cache_gib <= 0 and self.num_kv_blocks is None:
            raise ValueError("kv_cache_gib must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority; got {self.scheduling_policy!r}")
        if self.speculative_model and self.num_speculative_tokens < 1:
            raise ValueError("a speculative model needs num_speculative_tokens (the drafts per step) >= 1")
        if any(not prefix for prefix in self.public_prefixes):
            raise ValueError("a public prefix must hold at least one token id")
