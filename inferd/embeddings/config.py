"""An embedding replica's settings, written once: the fields (with their help) make its flags and spec keys."""
from dataclasses import Field, dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16")


def setting(default, help: str, choices: tuple[str, ...] = (), metavar: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar})


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
    num_threads: int | None = setting(None, "torch threads (default: all cores)")
    pack_weights: bool = setting(True, "prepack linear weights for oneDNN where the CPU supports the dtype "
                                 "(5-10 % faster here)")

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("max_batch_tokens", "max_batch_inputs", "max_queue_inputs", "max_queue_tokens", "num_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms: must be at least 0")


def settings() -> list[Field]:
    """The fields a user sets, for flags and spec keys."""
    return list(fields(EmbeddingConfig))
