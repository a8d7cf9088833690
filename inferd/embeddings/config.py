"""An embedding replica's settings, written once: the fields (with their help) make its flags and spec keys."""
from dataclasses import dataclass

from inferd.settings import SettingError, check_choices, setting

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(slots=True)
class EmbeddingConfig:
    dtype: str = setting("auto", "auto: bfloat16 where the CPU multiplies bf16 natively (AVX-512 BF16, AMX), "
                         "else float32 (benchmarks/results/embeddings.md)", DTYPES)
    max_batch_tokens: int = setting(8192, "tokens per model batch, special tokens included (a longer input "
                                    "goes alone)")
    max_batch_inputs: int = setting(64, "inputs per model batch")
    max_queue_delay_ms: float = setting(2.0, "after a busy batch, how long the next may wait to fill, from "
                                        "its oldest input's arrival; an idle model starts at once")
    max_queue_inputs: int = setting(8192, "inputs waiting at most; beyond: 503 with Retry-After")
    max_queue_tokens: int = setting(1 << 20, "tokens waiting at most; beyond: 503 with Retry-After")
    truncate: bool = setting(False, "cut inputs longer than the model reads instead of answering 400; a "
                             "request's own truncate field wins")
    matryoshka: bool = setting(False, "the model is trained for truncated embeddings: accept dimensions "
                               "below its own (truncated, then renormalised)")
    num_threads: int | None = setting(None, "torch threads, at most (default: the cores this process may run on)")
    adapt_threads: bool = setting(True, "a batch runs on fewer threads while other processes use this process's "
                                  "cores (inferd/models/cores.py); else always on num_threads")
    max_inflight_requests: int = setting(64, "requests the gateway sends one replica at once; its inputs wait in "
                                         "the replica's own queue")
    pack_weights: bool = setting(True, "prepack linear weights for oneDNN where the CPU supports the dtype "
                                 "(5-10 %% faster here)")

    def __post_init__(self):
        check_choices(self)
        for name in ("max_batch_tokens", "max_batch_inputs", "max_queue_inputs", "max_queue_tokens", "num_threads",
                     "max_inflight_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingError(name, "must be at least 1")
        if self.max_queue_delay_ms < 0:
            raise SettingError("max_queue_delay_ms", "must be at least 0")

    @property
    def replica_slots(self) -> int:
        """Requests the gateway lets run on one replica at once."""
        return self.max_inflight_requests
