"""The OpenAI request bodies (pydantic) as gateway and replica both read them, and the usage object."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.protocol.errors import ContextLengthExceeded, InvalidRequest
from inferd.protocol.tokenizer import Tokenizer

MAX_SEED = 2**63
MAX_CHOICES_PER_REQUEST = 256
MAX_EMBEDDING_INPUTS = 2048
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap on /v1/completions' logprobs (alternatives per token)
StopString = Annotated[str, Field(min_length=1)]
Prompt = str | list[str] | list[int] | list[list[int]]


# request bodies

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage so far on every chunk (the gateway bills by it)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            return {"role": role, "content": "\n".join(p.text for p in self.content)}
        return {"role": role, "content": self.content or ""}


class JSONSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced, as JSON Schema reads it


class ResponseFormatBody(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormatBody":
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequest("'response_format.json_schema' is required when its type is 'json_schema'",
                                 param="response_format.json_schema")
        return self


class SamplingRequest(_Body):
    """Fields shared by chat completions and completions."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-MAX_SEED, lt=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool | None = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    user: str | None = None
    response_format: ResponseFormatBody | None = None  # an extension on /v1/completions

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_settings(self) -> tuple[bool, int]:
        return False, 0

    def prompt_logprobs(self) -> bool:
        """Whether every prompt token's logprob is asked for (completions' echo with logprobs)."""
        return False

    def checked_max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        requested = self.requested_max_tokens()
        max_tokens = requested if requested is not None else max_model_len - num_prompt_tokens
        output = max(max_tokens, 0 if requested == 0 else 1)  # 0 only when asked for (echo: the prompt alone)
        if num_prompt_tokens + output > max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + output} tokens ({num_prompt_tokens} in the prompt, "
                f"{output} for the completion). Please reduce the prompt or max_tokens.",
                param=self._prompt_param(),
            )
        return max_tokens

    def _prompt_param(self) -> str:
        return "prompt"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_dict() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_settings(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    def _prompt_param(self) -> str:
        return "messages"


class CompletionRequest(SamplingRequest):
    """max_tokens may be 0 with echo: the prompt's tokens (and their logprobs) come back, nothing is sampled."""
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if not _is_prompt(value):
            raise InvalidRequest(
                "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
                param="prompt",
            )
        return value

    @model_validator(mode="after")
    def _check_fields(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("'max_tokens' may be 0 only with 'echo' (the prompt alone comes back)",
                                 param="max_tokens")
        if self.echo and self.stream:
            raise InvalidRequest("'echo' is not supported with 'stream'", param="echo")
        if self.echo and self.num_choices > 1:
            raise InvalidRequest("'echo' is not supported with 'n' above 1", param="echo")
        if self.suffix:
            raise InvalidRequest("'suffix' is not supported", param="suffix")
        if len(self.prompts()) * self.num_choices > MAX_CHOICES_PER_REQUEST:
            raise InvalidRequest(f"prompts × n may be at most {MAX_CHOICES_PER_REQUEST} per request", param="prompt")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of texts or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return p

    def logprob_settings(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompt_logprobs(self) -> bool:
        return bool(self.echo) and self.logprobs is not None

    def prompt_token_ids(self, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
        """Each prompt as token ids: a text encoded, ids checked against the vocabulary."""
        ids = [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in self.prompts()]
        check_token_ids(ids, vocab_size, "prompt")
        return ids


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): a text to the model's token ids."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape): token ids to text."""
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize_answer(tokenizer: Tokenizer, body: TokenizeRequest, max_model_len: int) -> dict:
    tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


def detokenize_answer(tokenizer: Tokenizer, body: DetokenizeRequest, vocab_size: int) -> dict:
    check_token_ids([body.tokens], vocab_size, "tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict:
    """GET /tokenizer_info (vLLM's): what lm-eval's remote tokenizer reads (special tokens, chat template)."""
    return {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": None,
            "chat_template": tokenizer.chat_template, "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size}


def check_token_ids(prompts: list[list[int]], vocab_size: int, param: str) -> None:
    """Raises InvalidRequest for a token id the model does not have (gateway and replica both call it)."""
    for i, ids in enumerate(prompts):
        if ids and max(ids) >= vocab_size:
            where = f"{param}[{i}]" if len(prompts) > 1 else param
            raise InvalidRequest(f"Invalid '{where}': token id {max(ids)} is not in the vocabulary (ids are "
                                 f"0 to {vocab_size - 1})", param=param, code="invalid_token_id")


class EmbeddingRequest(_Body):
    """POST /v1/embeddings. truncate is our extension: cut inputs longer than the model reads (else 400)."""
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        problem = _embedding_input_problem(value)
        if problem:
            raise InvalidRequest(f"Invalid 'input': {problem}", param="input")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The input as a list of texts or a list of token-id lists."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return self.input


# helpers

def _embedding_input_problem(value: Any) -> str | None:
    """Why value is not a string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(value, str):
        return "it is an empty string" if not value else None
    if not isinstance(value, list):
        return "it must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if not value:
        return "it is an empty list"
    if len(value) > MAX_EMBEDDING_INPUTS:
        return f"it holds {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed per request"
    if type(value[0]) is int:
        return None if _is_token_ids(value) else "a list of token ids must hold only non-negative integers"
    kind = str if isinstance(value[0], str) else list
    for i, item in enumerate(value):
        if kind is str and not isinstance(item, str):
            return f"input[{i}] is not a string; a list of texts must hold only strings"
        if kind is str and not item:
            return f"input[{i}] is an empty string"
        if kind is list and not _is_token_ids(item):
            return f"input[{i}] is not a non-empty list of non-negative token ids"
    return None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(type(t) is int and t >= 0 for t in value)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, str) for v in value) or _is_token_ids(value):
        return True
    return all(_is_token_ids(v) for v in value)


# usage

def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
