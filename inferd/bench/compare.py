import json
from pathlib import Path

from inferd.bench.errors import BenchError

SECTIONS = ("summary", "capacity")
SKIP = ("finish_reasons", "failed_by_type")


def load(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read the bench report {path}: {exc}") from exc
    if report.get("kind") not in ("run", "sweep"):
        raise BenchError(f"{path} is not an inferd bench report (give the .json written by bench run or sweep)")
    return report


def numbers(report: dict) -> dict[str, float]:
    """Numeric leaves of the summary (a sweep: its capacity and the summary at capacity), by dotted key."""
    if report["kind"] == "sweep":
        at = [p for p in report["points"] if p["rate_per_s"] == report["capacity"]["rate_per_s"]]
        report = {"capacity": report["capacity"], "summary": at[0]["summary"] if at else {}}
    return _flatten({k: report[k] for k in SECTIONS if k in report})


def _flatten(tree: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in tree.items():
        if key in SKIP:
            continue
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def compare_table(a: dict, b: dict) -> list[tuple[str, float, float, float | None]]:
    na, nb = numbers(a), numbers(b)
    return [(k, na[k], nb[k], nb[k] / na[k] if na[k] else None) for k in na if k in nb]


def format_table(rows: list[tuple[str, float, float, float | None]], name_a: str, name_b: str) -> str:
    width = max([len(r[0]) for r in rows] + [6])
    lines = [f"{'metric':<{width}}  {name_a[-14:]:>14}  {name_b[-14:]:>14}  {'B/A':>7}"]
    for key, va, vb, ratio in rows:
        lines.append(f"{key:<{width}}  {va:>14.4g}  {vb:>14.4g}  {'–' if ratio is None else f'{ratio:.3f}':>7}")
    return "\n".join(lines)
