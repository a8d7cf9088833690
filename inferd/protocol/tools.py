"""Tool calls: how offered tools and past calls are written into a prompt, the grammar that lets a model write
only well-formed calls, and the parsing of calls back out of its text, whole or as a stream.

A call is written in one format whatever the model (Hermes's, which Qwen's and Hermes's templates teach):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, a newline between blocks. The grammar (llguidance's Lark) pins every byte of a block but
the arguments, which follow the function's JSON schema; so whatever the model samples, a finished call names an
offered function and its arguments validate. With tool_choice "auto" the answer is either text (which then may
not begin with "<") or calls; "required" and a named function leave only calls. docs/serving.md has the rules.
"""
import functools
import json
from dataclasses import dataclass, field

import llguidance

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
HEAD = '{"name": "'
ARGUMENTS = '", "arguments": '
END = "}" + CLOSE  # the call's object, then the block
BETWEEN = "\n"  # between two blocks
MAX_ARGUMENT_WHITESPACE = 8  # characters in one run of whitespace in the arguments (a model cannot loop on it)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"


# the prompt

@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict | None  # a JSON schema; None: no arguments

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def as_dict(self) -> dict:
        out = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {k: v for k, v in out.items() if v is not None}


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (an assistant turn's past calls are written back the same way)."""
    return f"{OPEN}{HEAD}{name}{ARGUMENTS}{arguments}{END}"


def instructions(functions: list[Function], choice: str | None) -> str:
    """The system text that offers the functions, for templates without a tools section of their own.
    choice: "auto", "required", or the one function's name that must be called."""
    listed = "\n".join(json.dumps(f.as_dict(), ensure_ascii=False) for f in functions)
    if choice == "auto":
        when = "When a function helps, answer with calls only; otherwise answer in text."
    elif choice == "required":
        when = "Answer with one or more calls."
    else:
        when = f"Answer by calling {choice}."
    return (f"You can call these functions:\n{listed}\n\nTo call a function, write\n"
            f"{call_text('<function name>', '<arguments as JSON>')}\n{when}")


def response_text(content: str) -> str:
    """A tool's result, as the generic format hands it back to the model (in a user turn)."""
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"


def native_tools(chat_template: str | None) -> bool:
    """Whether the model's template writes tools itself (it reads the `tools` variable)."""
    return chat_template is not None and "tools" in chat_template


# the grammar

def grammar(functions: list[Function], choice: str, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of an answer: text or calls ("auto"), calls ("required"), or
    one call of the named function. parallel: more than one call may follow (not for a named one)."""
    offered = functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]
    parallel = parallel and choice in ("auto", "required")
    rules = [f"fn_{i}: {_lark_string(HEAD + f.name + ARGUMENTS)} %json {_bounded(f.schema)} {_lark_string('}')}"
             for i, f in enumerate(offered)]
    calls = f"call ({_lark_string(BETWEEN)} call)*" if parallel else "call"
    return "\n".join([
        "%llguidance {}",
        f"start: {'TEXT | ' if choice == 'auto' else ''}calls",
        f"calls: {calls}",
        f"call: {_lark_string(OPEN)} ({' | '.join(f'fn_{i}' for i in range(len(offered)))}) {_lark_string(CLOSE)}",
        *rules,
        r"TEXT: /[^<][\s\S]*/",  # text that cannot be mistaken for a call
    ])


@functools.lru_cache(maxsize=1024)
def schema_problem(schema_json: str) -> str | None:
    """Why the grammar cannot take this JSON schema (compact JSON text), or None."""
    try:
        compiled = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(compiled) or None


def _bounded(schema: dict) -> str:
    return json.dumps(schema | {"x-guidance": {"whitespace_pattern": rf"[ \n\r\t]{{0,{MAX_ARGUMENT_WHITESPACE}}}"}},
                      separators=(",", ":"))


def _lark_string(text: str) -> str:
    return json.dumps(text)


# parsing what the model wrote

@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class CallParser:
    """Reads an answer written under grammar(): its text, or its calls, piece by piece as they are sampled.
    feed() returns the chat-completion chunk deltas of each piece; the whole answer is feed() of all of it.
    auto: the answer may be text (it is when it does not begin with "<")."""
    id_prefix: str
    auto: bool
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    mode: str = "undecided"  # "text", or "calls" then
    _pos: int = 0  # what of text is parsed
    _state: str = "open"  # in calls: "open" (a block's start next), "name", "arguments"

    @property
    def complete(self) -> bool:
        """Calls, each finished (an answer cut at max_tokens may end inside one)."""
        return self.mode == "calls" and bool(self.calls) and self._state == "open"

    def finished(self, text: str) -> list[Call]:
        """The finished calls of a whole answer (none: it is text, or its one call was cut short)."""
        self.feed(text)
        return [c for c in self.calls if c.done]

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if self.mode == "undecided" and self.text:
            self.mode = "text" if self.auto and not self.text.startswith("<") else "calls"
        if self.mode == "text":
            return [{"content": piece}] if piece else []
        return [{"tool_calls": [d]} for d in self._parse()]

    def _parse(self) -> list[dict]:
        out, text = [], self.text
        while True:
            if self._state == "open":
                start = (BETWEEN if self.calls else "") + OPEN + HEAD
                if len(text) - self._pos < len(start):
                    return out
                if not text.startswith(start, self._pos):
                    raise ValueError("the answer is not a call where one must begin")
                self._pos, self._state = self._pos + len(start), "name"
            if self._state == "name":
                end = text.find(ARGUMENTS, self._pos)
                if end < 0:
                    return out
                call = Call(f"{self.id_prefix}_{len(self.calls)}", text[self._pos:end])
                self.calls.append(call)
                out.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
                self._pos, self._state = end + len(ARGUMENTS), "arguments"
            end = text.find(END, self._pos)
            upto = end if end >= 0 else max(len(text) - len(END) + 1, self._pos)  # keep back what may be END
            call = self.calls[-1]
            if upto > self._pos:
                call.arguments += text[self._pos:upto]
                out.append({"index": len(self.calls) - 1, "function": {"arguments": text[self._pos:upto]}})
            if end < 0:
                self._pos = upto
                return out
            call.done = True
            self._pos, self._state = end + len(END), "open"
