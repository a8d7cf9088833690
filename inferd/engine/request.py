from dataclasses import dataclass, field


class EngineError(Exception):
    """A request the engine cannot take; the message is shown to the user."""


class GrammarError(EngineError):
    """A response format whose grammar cannot be built (an invalid or unsupported JSON schema)."""


class EngineDeadError(Exception):
    """The engine loop stopped; nothing can run until the replica restarts."""


@dataclass(slots=True, frozen=True)
class ResponseFormat:
    """Output constrained to JSON: any object ("json_object") or one matching a JSON schema ("json_schema");
    or to a grammar in llguidance's Lark dialect ("lark": tool calls, protocol/tools.py)."""
    type: str
    schema: str | None = None  # the JSON schema as compact JSON text, or the grammar (the grammar cache's key)

    def __post_init__(self):
        if self.type not in ("json_object", "json_schema", "lark"):
            raise EngineError(f"response format type must be json_object, json_schema or lark, not {self.type!r}")
        if (self.type != "json_object") != (self.schema is not None):
            raise EngineError(f"a {self.type} response format needs its schema or grammar, and json_object none")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives given with each logprob, of the output and of the prompt
    prompt_logprobs: bool = False  # the logprob of every prompt token after the first (no prefix-cache reuse)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # None: free text

    def __post_init__(self):
        if self.max_tokens < 0:
            raise EngineError("max_tokens must be at least 0 (0: the prompt is computed, nothing is sampled)")
        if not 0.0 <= self.temperature <= 2.0:
            raise EngineError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise EngineError("top_k must be 0 (off) or positive")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise EngineError("presence_penalty and frequency_penalty must be between -2 and 2")
        if not 0 <= self.top_logprobs <= 20:
            raise EngineError("top_logprobs must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """One update of one request: what is new since the last update."""
    request_id: str
    text: str  # new text, already cut at a stop string; never a partial stop string
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_time: float | None = None  # time.monotonic() of the first output token
    queue_time_s: float | None = None  # time from arrival to first scheduled
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (not the first), in the first output
