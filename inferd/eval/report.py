"""A run's report (JSON and Markdown), floors, and the comparison of two runs."""
import json
from collections.abc import Iterable
from pathlib import Path

from inferd.eval.docset import BEHAVIOURS
from inferd.eval.intervals import difference, wilson
from inferd.eval.run import ItemResult

METRICS = (*BEHAVIOURS, "citation", "overall")  # what a floor may name


def tally(passed: Iterable[bool]) -> dict:
    flags = list(passed)
    low, high = wilson(sum(flags), len(flags))
    return {"n": len(flags), "passed": sum(flags), "accuracy": sum(flags) / len(flags) if flags else 0.0,
            "low": low, "high": high}


def summarise(results: list[ItemResult]) -> dict:
    """Per behaviour, per domain, citation (answer items that passed and cited a supporting excerpt) and
    overall, each with its 95 % Wilson interval."""
    summary = {b: tally(r.passed for r in results if r.behaviour == b) for b in BEHAVIOURS}
    answers = [r for r in results if r.behaviour == "answer"]
    if answers and all(r.cited is not None or r.reply is None for r in answers):
        summary["citation"] = tally(r.passed and bool(r.cited) for r in answers)
    summary["overall"] = tally(r.passed for r in results)
    domains = sorted({r.domain for r in results})
    return {"metrics": summary, "domains": {d: tally(r.passed for r in results if r.domain == d) for d in domains}}


def parse_floor(text: str) -> dict[str, float]:
    """"answer=0.3,decline=0.5" -> {"answer": 0.3, "decline": 0.5}."""
    floor = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.partition("=")
        if name not in METRICS or not value:
            raise ValueError(f"floor {part!r}: expected NAME=SHARE, NAME one of {', '.join(METRICS)}")
        floor[name] = float(value)
        if not 0 <= floor[name] <= 1:
            raise ValueError(f"floor {part!r}: a share between 0 and 1")
    return floor


def below_floor(summary: dict, floor: dict[str, float]) -> list[str]:
    """One line per metric whose accuracy is below its floor (a missing metric is below it)."""
    out = []
    for name, minimum in floor.items():
        m = summary["metrics"].get(name)
        if m is None or m["accuracy"] < minimum:
            got = "not measured" if m is None else _pct(m)
            out.append(f"{name} {got} is below the floor {minimum:.0%}")
    return out


def report(meta: dict, results: list[ItemResult], floor: dict[str, float]) -> dict:
    summary = summarise(results)
    return meta | {"summary": summary, "floor": floor, "below_floor": below_floor(summary, floor),
                   "items": [r.to_json() for r in results]}


def write(rep: dict, prefix: Path) -> tuple[Path, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    js, md = prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")
    js.write_text(json.dumps(rep, indent=2) + "\n")
    md.write_text(markdown(rep))
    return js, md


def _pct(m: dict) -> str:
    return f"{m['accuracy']:.1%} [{m['low']:.1%}, {m['high']:.1%}]"


def markdown(rep: dict) -> str:
    lines = [f"# {rep['set']} ({rep['split'] or 'all'}): {rep['model']}", "",
             f"Prompt {rep['prompt_version']}, greedy, {len(rep['items'])} items, {rep['duration_s']:.0f} s, "
             f"against {rep['base_url']}. Intervals: 95 % Wilson.", "",
             "| metric | passed | accuracy [95 % CI] | floor |", "| --- | --- | --- | --- |"]
    for name, m in rep["summary"]["metrics"].items():
        floor = rep["floor"].get(name)
        lines.append(f"| {name} | {m['passed']}/{m['n']} | {_pct(m)} | {'' if floor is None else f'{floor:.0%}'} |")
    lines += ["", "| domain | passed | accuracy [95 % CI] |", "| --- | --- | --- |"]
    lines += [f"| {d} | {m['passed']}/{m['n']} | {_pct(m)} |" for d, m in rep["summary"]["domains"].items()]
    if rep["below_floor"]:
        lines += ["", "**Below the floor:** " + "; ".join(rep["below_floor"])]
    lines += ["", "## Items (failures first)", "", "| item | verdict | why | cited | reply |",
              "| --- | --- | --- | --- | --- |"]
    for r in sorted(rep["items"], key=lambda r: r["passed"]):
        reply = (r["reply"] or "").replace("|", "\\|").replace("\n", " ")
        cited = "" if r["cited"] is None else "yes" if r["cited"] else "no"
        lines.append(f"| {r['id']} | {'pass' if r['passed'] else 'FAIL'} | {r['reason']} | {cited} | {reply} |")
    return "\n".join(lines) + "\n"


# comparing two runs

def compare(a: dict, b: dict) -> dict:
    """B against A on the items both ran: per metric B - A with Newcombe's 95 % interval, and the items whose
    verdict flipped."""
    a_items, b_items = {r["id"]: r for r in a["items"]}, {r["id"]: r for r in b["items"]}
    common = [i for i in a_items if i in b_items]
    deltas = {}
    for name in METRICS:
        ma, mb = a["summary"]["metrics"].get(name), b["summary"]["metrics"].get(name)
        if ma and mb:
            delta, low, high = difference(mb["passed"], mb["n"], ma["passed"], ma["n"])
            deltas[name] = {"a": ma["accuracy"], "b": mb["accuracy"], "delta": delta, "low": low, "high": high}
    flipped = [{"id": i, "a": a_items[i]["passed"], "b": b_items[i]["passed"], "a_reason": a_items[i]["reason"],
                "b_reason": b_items[i]["reason"]} for i in common if a_items[i]["passed"] != b_items[i]["passed"]]
    return {"a": a["model"], "b": b["model"], "common_items": len(common), "deltas": deltas, "flipped": flipped}


def compare_markdown(c: dict, a_name: str, b_name: str) -> str:
    lines = [f"A: {a_name} ({c['a']})", f"B: {b_name} ({c['b']})", f"{c['common_items']} items in both", "",
             "| metric | A | B | B - A [95 % CI] |", "| --- | --- | --- | --- |"]
    for name, d in c["deltas"].items():
        mark = " (worse)" if d["high"] < 0 else " (better)" if d["low"] > 0 else ""
        lines.append(f"| {name} | {d['a']:.1%} | {d['b']:.1%} | {d['delta']:+.1%} [{d['low']:+.1%}, "
                     f"{d['high']:+.1%}]{mark} |")
    lines += ["", f"Flipped: {len(c['flipped'])}"]
    lines += [f"- {f['id']}: {'pass' if f['a'] else 'fail'} -> {'pass' if f['b'] else 'fail'} ({f['b_reason']})"
              for f in c["flipped"]]
    return "\n".join(lines) + "\n"
