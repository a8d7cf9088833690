"""A rollout's probes: prompts and the regex each answer must match (spec `rollout.policy.probes`), read once
when the spec is checked and again by the canary controller (rollout.py)."""
import json
import re
from dataclasses import dataclass
from pathlib import Path

from inferd.eval.jsonl import jsonl_lines


@dataclass(slots=True)
class Probe:
    messages: list[dict]
    expect: re.Pattern
    max_tokens: int = 16


def read_probes(path: str | Path) -> list[Probe]:
    """A JSONL probe set, one {"messages": [...], "expect": "regex", "max_tokens"?: n} per line."""
    probes = []
    for i, line in jsonl_lines(Path(path).expanduser().read_text()):
        try:
            raw = json.loads(line)
            assert isinstance(raw, dict) and set(raw) <= {"messages", "expect", "max_tokens"}, "unknown fields"
            assert isinstance(raw.get("messages"), list) and raw["messages"], "messages must be a non-empty list"
            assert isinstance(raw.get("expect"), str), "expect must be a regex string"
            probes.append(Probe(raw["messages"], re.compile(raw["expect"]), int(raw.get("max_tokens", 16))))
        except (ValueError, AssertionError, re.error) as exc:
            raise ValueError(f"line {i}: {exc}") from None
    if not probes:
        raise ValueError("no probes")
    return probes
