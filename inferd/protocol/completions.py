"""Chat completions as the providers' protocols read and write them (anthropic.py, gemini.py, bedrock.py): a
message's text, a conversation's system texts and turns, and an answer with its choices and usage; and a whole
answer as the chunks of its stream (a response cache's hit, replayed)."""
import time
from collections.abc import Callable


def text_of(content) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content)
    return content or ""


def conversation(chat: dict, turn: Callable[[dict], tuple[str, list[dict]]], key: str) -> tuple[list[str], list[dict]]:
    """The system (and developer) texts, and the other messages as the provider's turns ({"role", key: blocks}):
    consecutive turns of one role are one (tool results, and the user's text after them)."""
    system, turns = [], []
    for m in chat["messages"]:
        if m["role"] in ("system", "developer"):
            system.append(text_of(m.get("content")))
            continue
        role, blocks = turn(m)
        if turns and turns[-1]["role"] == role:
            turns[-1][key] += blocks
        else:
            turns.append({"role": role, key: blocks})
    return system, turns


def message(text: str, calls: list[dict]) -> dict:
    """An answer's message: its text (null beside calls and nothing else) and its tool calls, if any."""
    out = {"role": "assistant", "content": text or (None if calls else "")}
    return out | {"tool_calls": calls} if calls else out


def completion(id_: str, model: str | None, choices: list[dict], usage: dict) -> dict:
    """A whole chat completion; choices: each {"index", "message", "finish_reason"}."""
    return {"id": "chatcmpl-" + id_, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [c | {"logprobs": None} for c in choices], "usage": usage}


def usage(prompt: int, cached: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def as_chunks(answer: dict, include_usage: bool) -> list[dict]:
    """A whole chat completion or text completion as the chunks of its stream: each choice's content (its text,
    tool calls and logprobs) in one chunk, then its finish reason; then the usage, if asked for."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created"), "model": answer.get("model")}
    out = []
    for c in answer.get("choices") or []:
        if chat:
            delta = {k: v for k, v in (c.get("message") or {}).items() if v is not None}
            delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(delta.get("tool_calls") or [])]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
            body = {"index": c.get("index", 0), "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}
            end = {"index": c.get("index", 0), "delta": {}, "logprobs": None, "finish_reason": c.get("finish_reason")}
        else:
            body = {"index": c.get("index", 0), "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                    "finish_reason": None}
            end = {"index": c.get("index", 0), "text": "", "logprobs": None, "finish_reason": c.get("finish_reason")}
        out += [head | {"choices": [body]}, head | {"choices": [end]}]
    if include_usage and answer.get("usage"):
        out.append(head | {"choices": [], "usage": answer["usage"]})
    return out
