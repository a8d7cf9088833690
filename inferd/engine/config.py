"""The engine's settings, written once: EngineConfig's fields make the `inferd serve|replica` flags, the
deployment spec's `runtime:` section and the arguments a replica process is started with (inferd/settings.py)."""
from dataclasses import dataclass, field

from inferd.settings import SettingError, check_choices, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4", "auto")
SCHEDULING_POLICIES = ("priority", "fcfs")


@dataclass(slots=True)
class EngineConfig:
    dtype: str = setting("auto", "auto: bfloat16 where the CPU has native bf16 matmul, else float32 (on AVX2 "
                         "without AVX-512, float32 rows on the weights kept in bfloat16)", DTYPES)
    max_num_seqs: int = setting(64, "sequences running at once")
    max_num_batched_tokens: int = setting(512, "tokens per step; longer prompts are prefilled in chunks "
                                          "(benchmarks/chunked_prefill.py)")
    kv_cache_gib: float = setting(1.0, "KV cache size in GiB")
    num_kv_blocks: int | None = setting(None, "KV cache size in blocks; overrides kv_cache_gib")
    block_size: int = setting(16, "tokens per KV cache block")
    max_model_len: int | None = setting(None, "default: the model's context length")
    pack_weights: bool = setting(True, "prepack linear weights for oneDNN where the CPU supports the dtype")
    one_row_weights: bool = setting(True, "bfloat16 without quantization on a CPU with AVX-512 BF16: a second copy "
                                    "of the linear weights for steps of one row (decode of one sequence), "
                                    "1.15-1.2x oneDNN's reads there (benchmarks/linears.py)")
    huge_page_weights: bool = setting(True, "copy the weights onto 2 MiB pages (Linux transparent huge pages) at "
                                      "load: fewer TLB misses where a step reads every weight "
                                      "(benchmarks/engine_ab.py --change huge_page_weights)")
    quantization: str = setting("none", "int8: weight-only int8 linears, per output channel, float32 "
                                "activations; int4: 4-bit Q4_1 groups of 32 (a Q4_1 GGUF's own weights), "
                                "bfloat16 linear inputs where the CPU has native bf16, float32 ones (rounded to 16 "
                                "bits a group) on AVX2; auto: the fastest of these on this CPU", QUANTIZATIONS)
    cpp_kernels: bool = setting(True, "the decoder's norms, RoPE, cache writes, decode attention and silu in C++ "
                                "(float32 and bfloat16), built on first use; else torch ops")
    num_threads: int | None = setting(None, "torch threads for the engine, at most (default: the cores this process "
                                      "may run on)")
    adapt_threads: bool = setting(True, "a step runs on fewer threads while other processes use this process's "
                                  "cores (inferd/models/cores.py); else always on num_threads")
    small_step_threads: int | None = setting(None, "torch threads for a decode step of at most small_step_seqs "
                                             "sequences, for a machine whose cores other work needs (default: "
                                             "num_threads)")
    small_step_seqs: int = setting(4, "sequences up to which a decode-only step is small (small_step_threads)")
    num_speculative_tokens: int = setting(0, "drafts verified per decode step (0: off); drafted by prompt "
                                          "lookup unless speculative_model is set")
    speculative_model: str | None = setting(None, "draft model: a smaller .gguf or model directory of the same "
                                            "tokenizer, or layers:N (the model's own first N layers); needs "
                                            "num_speculative_tokens", metavar="PATH|layers:N")
    scheduling_policy: str = setting("priority", "priority: the gateway's class (interactive before batch, "
                                     "batch preempted first); fcfs", SCHEDULING_POLICIES)
    lower_class_seqs: int = setting(0, "priority policy: sequences of a lower class (batch) stepped while a higher "
                                    "class has work; the others keep their KV blocks and wait, so interactive "
                                    "steps stay short (0: none)")
    enable_prefix_caching: bool = setting(True, "reuse the KV of full prompt blocks seen before in the same "
                                          "cache namespace")
    public_prefixes: list[list[int]] = field(default_factory=list, metadata={"setting": False})  # token ids

    def __post_init__(self):
        check_choices(self)
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "max_model_len",
                     "num_threads", "small_step_threads", "small_step_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingError(name, "must be at least 1")
        if self.lower_class_seqs < 0:
            raise SettingError("lower_class_seqs", "must be at least 0")
        if self.kv_cache_gib <= 0 and self.num_kv_blocks is None:
            raise SettingError("kv_cache_gib", "must be above 0")
        if self.num_speculative_tokens < 0:
            raise SettingError("num_speculative_tokens", "must be at least 0")
        if self.speculative_model and self.num_speculative_tokens < 1:
            raise SettingError("speculative_model", "needs num_speculative_tokens (the drafts per step) >= 1")
        if any(not prefix for prefix in self.public_prefixes):
            raise SettingError("public_prefixes", "a public prefix must hold at least one token id")

    @property
    def replica_slots(self) -> int:
        """Requests the gateway lets run on one replica at once."""
        return self.max_num_seqs
