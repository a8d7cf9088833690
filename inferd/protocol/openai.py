"""The OpenAI request bodies (pydantic) as gateway and replica both read them, and the usage object."""
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.protocol.errors import ContextLengthExceeded, InvalidRequest
from inferd.protocol.tokenizer import Tokenizer
from inferd.protocol.tools import (BETWEEN, Function, call_text, instructions, native_tools, response_text,
                                   schema_problem)

MAX_SEED = 2**63
MAX_CHOICES_PER_REQUEST = 256
MAX_EMBEDDING_INPUTS = 2048
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap on /v1/completions' logprobs (alternatives per token)
MAX_TOOLS = 128  # OpenAI's
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


class FunctionCallBody(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallBody(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def as_template_dict(self, native_tools: bool = False) -> dict:
        """The message as a chat template reads it; native_tools: the template writes calls and results itself
        (Hugging Face's convention), else they are written in tools' generic format."""
        role = "system" if self.role == "developer" else self.role
        if self.role == "tool":
            if native_tools:
                return {"role": "tool", "content": self.text, "tool_call_id": self.tool_call_id}
            return {"role": "user", "content": response_text(self.text)}
        if not self.tool_calls:
            return {"role": role, "content": self.text}
        if native_tools:
            calls = [{"type": "function", "id": c.id, "function": {"name": c.function.name,
                                                                   "arguments": json.loads(c.function.arguments)}}
                     for c in self.tool_calls]
            return {"role": role, "content": self.text, "tool_calls": calls}
        written = BETWEEN.join(call_text(c.function.name, c.function.arguments) for c in self.tool_calls)
        return {"role": role, "content": f"{self.text}\n{written}" if self.text else written}


class FunctionBody(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # accepted; the arguments always follow the schema


class ToolBody(_Body):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


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
    tools: list[ToolBody] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        _check_history(self.messages)
        _check_tools(self.tools or [], self.tool_choice)
        if self.tool_mode() is not None and self.response_format and self.response_format.type != "text":
            raise InvalidRequest("'response_format' cannot be used with tools unless tool_choice is 'none'",
                                 param="response_format")
        return self

    def tool_mode(self) -> str | None:
        """How the answer may call the tools: "auto", "required", the one function's name; None: it may not."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if not self.tools or choice == "none":
            return None
        return choice if isinstance(choice, str) else choice.function.name

    def check_tool_schemas(self) -> None:
        """InvalidRequest naming the first tool whose parameters the grammar cannot enforce. It compiles each new
        schema (a large one takes long): the replica calls it off its event loop, the gateway not
        at all (a provider checks its own)."""
        if self.tool_mode() is None:
            return
        for i, tool in enumerate(self.tools or []):
            if tool.function.parameters is not None:
                problem = schema_problem(json.dumps(tool.function.parameters, separators=(",", ":")))
                if problem:
                    raise InvalidRequest(f"the parameters of the tool '{tool.function.name}' are not a JSON schema "
                                         f"inferd can enforce: {problem}", param=f"tools[{i}].function.parameters")

    def functions(self) -> list[Function]:
        return [Function(t.function.name, t.function.description, t.function.parameters)
                for t in self.tools or []]

    def chat_prompt(self, tokenizer: Tokenizer) -> str:
        """The prompt text: the conversation in the model's chat template, with the tools it may call (in the
        template's own tools section, or in tools' generic format as system text). Raises ValueError."""
        native = native_tools(tokenizer.chat_template)
        messages = [m.as_template_dict(native) for m in self.messages]
        mode = self.tool_mode()
        if mode is None:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if native:
            offered = [{"type": "function", "function": f.as_dict()} for f in self.functions()]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=offered)
        text = instructions(self.functions(), mode)
        if messages[0]["role"] == "system":
            messages[0] = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}"}
        else:
            messages.insert(0, {"role": "system", "content": text})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

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

def _check_history(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest("only an assistant message may hold 'tool_calls'", param=f"messages[{i}].tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise InvalidRequest("a tool message needs the 'tool_call_id' of the call it answers",
                                 param=f"messages[{i}].tool_call_id")
        for j, call in enumerate(m.tool_calls or []):
            try:
                json.loads(call.function.arguments)
            except ValueError:
                raise InvalidRequest("a call's 'arguments' must be JSON text",
                                     param=f"messages[{i}].tool_calls[{j}].function.arguments") from None


def _check_tools(offered: list[ToolBody], choice) -> None:
    names = [t.function.name for t in offered]
    if choice not in (None, "none") and not offered:
        raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequest(f"'tool_choice' names the function '{choice.function.name}', which is not in "
                             "'tools'", param="tool_choice")
    for i, tool in enumerate(offered):
        if names.index(tool.function.name) != i:
            raise InvalidRequest(f"two tools are named '{tool.function.name}'", param=f"tools[{i}].function.name")


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
