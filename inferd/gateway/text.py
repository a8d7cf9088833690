"""The text kind at the gateway: chat and completion bodies, counted in the model's own tokens and bounded;
Anthropic's messages, served as the chat completion of the same conversation and answered in its own shape."""
from dataclasses import replace

from inferd.gateway.charges import Plan, check_request_limits
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import Deployment
from inferd.gateway.kinds import Operation
from inferd.gateway.policy import KeyPolicy
from inferd.gateway.runtimes import stream_options
from inferd.protocol.anthropic import MessagesAnswer, MessagesRequest
from inferd.protocol.errors import InvalidRequest
from inferd.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingRequest


def plan(d: Deployment, key: KeyPolicy, body: SamplingRequest, raw: dict, price: ModelPrice) -> Plan:
    """Count the prompt in the model's tokens, apply per-request limits, and bound what it may cost."""
    tokenizer, max_model_len = d.model.tokenizer, d.model.max_model_len
    if isinstance(body, ChatCompletionRequest):
        try:
            text = body.chat_prompt(tokenizer)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        ids, param = [tokenizer.encode(text, add_special_tokens=False)], "messages"
    else:
        ids, param = body.prompt_token_ids(tokenizer, tokenizer.vocab_size), "prompt"
    lens = [len(i) for i in ids]
    if min(lens) == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    requested = body.requested_max_tokens()
    cap = check_request_limits(key, d.name, max(lens), requested, param)
    per_output = body.checked_max_tokens(max(lens), max_model_len)
    upstream = dict(raw, model=d.upstream_model or d.name)
    if requested is None:
        per_output = max(max_model_len - min(lens), 1)
        if cap is not None:
            per_output = upstream["max_tokens"] = min(cap, per_output)
    if body.stream and (options := stream_options(d)):  # an external server's usage comes only in its chunks
        upstream["stream_options"] = options
    outputs = len(lens) * body.num_choices
    mode = "continuous" if body.continuous_usage else "final" if body.include_usage else "none"
    return Plan(sum(lens), per_output, outputs, price.cost_usd(sum(lens), 0, per_output * outputs), upstream,
                bool(body.stream), mode, ids[0])


def cap_output(p: Plan, cap: int, price: ModelPrice) -> Plan:
    """The plan with at most `cap` output tokens per choice (the degradation ladder's cap)."""
    body = dict(p.body, max_tokens=cap)
    body.pop("max_completion_tokens", None)
    return replace(p, max_output_tokens=cap, cost_usd=price.cost_usd(p.prompt_tokens, 0, cap * p.num_outputs),
                   body=body)


def plan_messages(d: Deployment, key: KeyPolicy, body: MessagesRequest, raw: dict, price: ModelPrice) -> Plan:
    """A messages request planned as its chat completion, which the replica is sent."""
    chat = body.chat()
    return replace(plan(d, key, ChatCompletionRequest.model_validate(chat), chat, price), path="/v1/chat/completions")


def messages_answer(p: Plan) -> MessagesAnswer:
    return MessagesAnswer(p.prompt_tokens)


OPERATIONS = (Operation("chat", "/v1/chat/completions", ChatCompletionRequest, "text", plan, cap_output),
              Operation("text_completion", "/v1/completions", CompletionRequest, "text", plan, cap_output),
              Operation("chat", "/v1/messages", MessagesRequest, "text", plan_messages, cap_output,
                        answer=messages_answer))
