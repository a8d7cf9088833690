"""Chat completions as the providers' protocols read and write them (anthropic.py, gemini.py, bedrock.py): a
message's text, a conversation's system texts and turns, and an answer with its choices and usage."""
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
