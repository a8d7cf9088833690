"""From OpenAI request bodies to engine parameters, and from engine outputs to OpenAI response bodies."""
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.engine.request import RequestOutput, ResponseFormat, SamplingParams, TokenLogprob
from inferd.protocol import tools
from inferd.protocol.ids import new_id
from inferd.protocol.openai import MAX_SEED, ChatCompletionRequest, SamplingRequest

TokenBytes = Callable[[int], bytes]


# request bodies → engine parameters

def sampling_params(body: SamplingRequest, num_prompt_tokens: int, max_model_len: int,
                    choice: int = 0) -> SamplingParams:
    """Engine parameters for one choice of one prompt; raises ContextLengthExceeded."""
    max_tokens = body.checked_max_tokens(num_prompt_tokens, max_model_len)
    logprobs, top_logprobs = body.logprob_settings()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=_choice_seed(body.seed, choice),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=body.prompt_logprobs(),
        response_format=engine_format(body),
    )


def engine_format(body: SamplingRequest) -> ResponseFormat | None:
    """The grammar the answer follows: the tool calls' (protocol/tools.py), the response format's, or none."""
    if isinstance(body, ChatCompletionRequest) and (mode := body.tool_mode()) is not None:
        return ResponseFormat("lark", tools.grammar(body.functions(), mode, body.parallel_tool_calls is not False))
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ResponseFormat("json_object")
    # keys keep their order: properties are written in the order the schema declares them
    return ResponseFormat("json_schema", json.dumps(rf.json_schema.schema_, separators=(",", ":")))


def _choice_seed(seed: int | None, choice: int) -> int | None:
    if seed is None or choice == 0:
        return seed
    return (seed + choice) % MAX_SEED


# engine outputs → response bodies

@dataclass(slots=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    system_fingerprint: str | None


@dataclass(slots=True)
class ChoiceResult:
    """One choice accumulated from its engine outputs (non-streaming)."""
    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (echo with logprobs)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    first_token_time: float | None = None  # time.monotonic() of the choice's first output token

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.text)
        self.logprobs.extend(out.logprobs or [])
        self.prompt_logprobs.extend(out.prompt_logprobs or [])
        self.count(out)
        if out.finished:
            self.finish_reason = out.finish_reason

    def count(self, out: RequestOutput) -> None:
        """Token counts only (streaming sends the text and logprobs on at once)."""
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if self.first_token_time is None:
            self.first_token_time = out.first_token_time

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _envelope(meta: ResponseMeta, obj: str) -> dict:
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "system_fingerprint": meta.system_fingerprint}


def token_text(raw: bytes) -> str:
    """A token's text; a piece of a UTF-8 character shows as U+FFFD (its `bytes` carry the truth)."""
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytes) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}
    content = [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, l) for t, l in lp.top]} for lp in lps]
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytes, text_offset: int) -> dict:
    tokens = [token_text(token_bytes(lp.token_id)) for lp in lps]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(token_bytes(t)): l for t, l in lp.top} for lp in lps],
            "text_offset": offsets}


def chat_response(meta: ResponseMeta, choices: list[ChoiceResult], usage: dict, token_bytes: TokenBytes,
                  with_logprobs: bool, parsers: list[tools.CallParser] | None = None) -> dict:
    """parsers: one per choice where the answer may call tools (call_parsers)."""
    def choice(c: ChoiceResult) -> dict:
        message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
        if parsers and (calls := parsers[c.index].finished(c.text)):  # a call cut at max_tokens is left out
            message = {"role": "assistant", "content": None, "tool_calls": [call.as_dict() for call in calls]}
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message,
                "logprobs": chat_logprobs(c.logprobs, token_bytes) if with_logprobs else None, "finish_reason": finish}
    return _envelope(meta, "chat.completion") | {"choices": [choice(c) for c in choices], "usage": usage}


def call_parsers(body: ChatCompletionRequest, n: int) -> list[tools.CallParser] | None:
    """A parser per choice of an answer that may call tools, else None."""
    mode = body.tool_mode()
    if mode is None:
        return None
    return [tools.CallParser(f"call_{new_id()}", auto=mode == "auto") for _ in range(n)]


def chat_chunk(meta: ResponseMeta, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
               usage: bool | dict) -> dict:
    """usage: False (no field), True (null, as with include_usage) or the usage so far."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(meta, "chat.completion.chunk") | {"choices": [choice]} | _chunk_usage(usage)


@dataclass(slots=True)
class Echo:
    """A choice's prompt, as echo returns it before the completion."""
    text: str
    token_ids: list[int]


def completion_response(meta: ResponseMeta, choices: list[ChoiceResult], usage: dict, token_bytes: TokenBytes,
                        with_logprobs: bool, echoes: list[Echo] | None = None) -> dict:
    """echoes: one per choice (echo asked): its prompt before its text, and its prompt tokens' logprobs first."""
    def choice(c: ChoiceResult, echo: Echo | None) -> dict:
        text = echo.text + c.text if echo else c.text
        logprobs = None
        if with_logprobs:
            logprobs = completion_logprobs(c.logprobs, token_bytes, len(echo.text) if echo else 0)
            if echo:
                prompt = echo_logprobs(echo, c.prompt_logprobs, token_bytes)
                logprobs = {k: prompt[k] + logprobs[k] for k in prompt}
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
    body = [choice(c, echoes[i] if echoes else None) for i, c in enumerate(choices)]
    return _envelope(meta, "text_completion") | {"choices": body, "usage": usage}


def echo_logprobs(echo: Echo, scored: list[TokenLogprob], token_bytes: TokenBytes) -> dict:
    """The prompt's tokens in completion_logprobs' shape; the first has no logprob and no alternatives (null)."""
    assert [lp.token_id for lp in scored] == echo.token_ids[1:], "prompt logprobs of other tokens than the prompt's"
    first = token_text(token_bytes(echo.token_ids[0]))
    rest = completion_logprobs(scored, token_bytes, len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def completion_chunk(meta: ResponseMeta, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                     usage: bool | dict) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(meta, "text_completion") | {"choices": [choice]} | _chunk_usage(usage)


def _chunk_usage(usage: bool | dict) -> dict:
    if isinstance(usage, dict):
        return {"usage": usage}
    return {"usage": None} if usage else {}


def usage_chunk(meta: ResponseMeta, obj: str, usage: dict) -> dict:
    return _envelope(meta, obj) | {"choices": [], "usage": usage}
