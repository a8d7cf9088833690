"""benchmarks/classical.py's results as Markdown: the rate each system holds, then every cell."""

NAMES = {"inferd": "inferd (gateway + replica, batched)",
         "inferd-in-process": "inferd (the model in the gateway's process, batched)", "ray": "Ray Serve (@serve.batch)",
         "plain": "plain Starlette + library (unbatched)"}


def markdown(r: dict) -> str:
    m = r["machine"]
    systems = r["systems"]
    models = next(iter(systems.values())).keys() if systems else []
    out = [f"# Classical models: inferd vs Ray Serve vs a plain server ({r['date']})", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, **shared** with another developer's tests and benchmarks "
           f"(load average {m['load_average_before'][0]:.2f} before, {m['load_average_after'][0]:.2f} after); the "
           "load generator runs on the same cores. Versions: "
           + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".", "",
           f"Each cell ran {r['cell_s']} s. Open loop: single-row requests at a fixed arrival rate, latency "
           "from each request's due time; a sweep stops at the first rate missed. inferd's requests pass its "
           "gateway (key, limits, usage record) and then its replica (a process of its own, a second hop; "
           "`inferd-in-process`: in the gateway's process, called on its loop), each parsing (orjson) and "
           "checking every row against the schema; the peers parse with the standard json module (Starlette's "
           "`request.json()`) and check nothing. One model thread everywhere.", "",
           f"## Highest arrival rate held at p99 <= {r['p99_target_ms']:g} ms (single-row requests/s)", "",
           "| model | " + " | ".join(NAMES[s] for s in systems) + " | inferd / Ray | inferd / plain |",
           "|---|" + "---|" * (len(systems) + 2)]
    for model in models:
        held = {s: systems[s][model]["max_rate_p99_20ms"] for s in systems}
        out.append(f"| {model} | " + " | ".join(str(held[s] or "< " + str(r["rates"][0])) for s in systems)
                   + f" | {_ratio(held.get('inferd'), held.get('ray'))} | {_ratio(held.get('inferd'), held.get('plain'))} |")
    columns = {f"{s} (columns)": (s, "batches_columns") for s in systems if "batches_columns" in
               next(iter(systems[s].values()))}
    shown = {s: (s, "batches") for s in systems} | columns
    out += ["", "## Client batches (closed loop): rows/s, p50 / p99 ms per request", "",
            "inferd's requests are named rows (`inputs`), and again column-major (`columns`, a third of the "
            "bytes); the peers' are rows as plain lists.", "",
            "| model | rows/request | " + " | ".join(NAMES.get(s, s) for s in shown)
            + " | inferd / Ray | inferd / plain | inferd (columns) / plain |",
            "|---|---|" + "---|" * (len(shown) + 3)]
    for model in models:
        for batch in r["batches"]:
            cells = {name: systems[s][model][key][str(batch)] for name, (s, key) in shown.items()}
            row = " | ".join(f"{c['rows_s']:,.0f} ({c['p50_ms']} / {c['p99_ms']})" for c in cells.values())
            rows = {s: c["rows_s"] for s, c in cells.items()}
            out.append(f"| {model} | {batch} | {row} | {_ratio(rows.get('inferd'), rows.get('ray'))} | "
                       f"{_ratio(rows.get('inferd'), rows.get('plain'))} | "
                       f"{_ratio(rows.get('inferd (columns)'), rows.get('plain'))} |")
    out += ["", "## Every rate cell: achieved rows/s, p50 / p99 ms, errors", ""]
    for s in systems:
        for model in models:
            cells = systems[s][model]["rates"]
            out.append(f"- {s} {model}: " + "; ".join(
                f"{rate}/s → {c['rows_s']:,.0f} rows/s, {c['p50_ms']} / {c['p99_ms']} ms"
                + (f", {c['errors']} errors" if c["errors"] else "") for rate, c in cells.items()))
    if r["notes"]:
        out += ["", "Notes: " + "; ".join(f"{k}: {v}" for k, v in r["notes"].items())]
    return "\n".join(out) + "\n"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"
