import json
from dataclasses import dataclass
from pathlib import Path

from inferd.bench.errors import WorkloadError
from inferd.eval.jsonl import jsonl_lines

FIELDS = {"arrival_offset_s", "input_tokens", "text", "output_tokens"}


@dataclass(slots=True)
class TraceEntry:
    """One line of a trace: when it arrives, its input (a token count or a text) and its output length."""
    arrival_offset_s: float
    output_tokens: int
    input_tokens: int | None = None
    text: str | None = None


def read_trace(path: Path) -> list[TraceEntry]:
    """JSONL, one object a line: {"arrival_offset_s", "input_tokens" or "text", "output_tokens"}; sorted by arrival."""
    if not path.is_file():
        raise WorkloadError(f"trace file {path} does not exist")
    entries = []
    for lineno, line in jsonl_lines(path.read_text(encoding="utf-8")):
        entries.append(parse_entry(line, f"{path}:{lineno}"))
    if not entries:
        raise WorkloadError(f"trace file {path} has no entries")
    return sorted(entries, key=lambda e: e.arrival_offset_s)


def parse_entry(line: str, where: str) -> TraceEntry:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(raw, dict):
        raise WorkloadError(f"{where}: expected a JSON object with {sorted(FIELDS)}")
    if unknown := set(raw) - FIELDS:
        raise WorkloadError(f"{where}: unknown fields {sorted(unknown)}; a trace line has {sorted(FIELDS)}")
    if ("input_tokens" in raw) == ("text" in raw):
        raise WorkloadError(f"{where}: give exactly one of 'input_tokens' and 'text'")
    entry = TraceEntry(_number(raw, "arrival_offset_s", where, float), _number(raw, "output_tokens", where, int),
                       input_tokens=_number(raw, "input_tokens", where, int) if "input_tokens" in raw else None,
                       text=raw.get("text"))
    if entry.text is not None and not (isinstance(entry.text, str) and entry.text):
        raise WorkloadError(f"{where}: 'text' must be a non-empty string")
    return entry


def _number(raw: dict, key: str, where: str, kind: type) -> float | int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise WorkloadError(f"{where}: '{key}' must be a {'whole ' if kind is int else ''}number (got {value!r})")
    if value < 0 or (key != "arrival_offset_s" and value < 1):
        raise WorkloadError(f"{where}: '{key}' is out of range (got {value})")
    return kind(value)
