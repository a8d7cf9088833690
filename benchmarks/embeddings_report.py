"""benchmarks/embeddings.py's results as Markdown: the dtype table, the matrix, the ratios, the cost."""
SIZES = (1, 8, 32, 128)


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"# Embeddings: all-MiniLM-L6-v2 ({r['date']})", "",
             f"{m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}; bf16 flags: "
             f"{', '.join(m['bf16_flags']) or 'none'}); Python {m['python']}, torch {m['torch']}, "
             f"sentence-transformers {m['sentence_transformers']}. **A shared machine** (another developer's "
             f"tests may run at the same time): load average before {_load(m['load_average_before'])}, after "
             f"{_load(m['load_average_after'])}.",
             "", f"Mean tokens per input (special tokens included): short {r['mean_tokens']['short']:.1f}, "
             f"long {r['mean_tokens']['long']:.1f}. One client, closed loop, about {r['budget_s']} s per cell.", ""]
    lines += _dtypes(r["forward_ms"]) + _matrix(r) + _ratios(r) + _cost(r)
    for name, note in r["notes"].items():
        lines += [f"**{name}**: {note}", ""]
    return "\n".join(lines)


def _load(values) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _dtypes(ms: dict) -> list[str]:
    lengths = sorted({key.split("x")[1] for key in ms}, key=int)
    head = "| our forward alone, batch 32, min / median ms | " + " | ".join(f"32 x {n} tokens" for n in lengths) + " |"
    rows = [f"| {d} | " + " | ".join(f"{ms[f'{d}/32x{n}']['min_ms']} / {ms[f'{d}/32x{n}']['median_ms']}"
                                     for n in lengths) + " |" for d in ("float32", "bfloat16")]
    speedup = "| bf16 speed-up (medians) | " + " | ".join(
        f"{ms[f'float32/32x{n}']['median_ms'] / ms[f'bfloat16/32x{n}']['median_ms']:.2f}x" for n in lengths) + " |"
    return ["## bf16 against fp32 (what `dtype: auto` picks rests on this)", "", head, "|---|" + "---|" * len(lengths),
            *rows, speedup, ""]


def _matrix(r: dict) -> list[str]:
    lines = []
    for length in ("short", "long"):
        lines += [f"## {length} inputs: inputs/s (p50 / p99 ms per request) by client batch size", "",
                  "| | " + " | ".join(f"batch {b}" for b in SIZES) + " |", "|---|" + "---|" * len(SIZES)]
        for name, cells in r["systems"].items():
            row = [cells[f"{length}/{b}"] for b in SIZES]
            lines.append(f"| {name} | " + " | ".join(f"{c['inputs_s']} ({c['p50_ms']} / {c['p99_ms']})" for c in row)
                         + " |")
        lines.append("")
    return lines


def _best(r: dict, prefix: str, cell: str) -> tuple[str, float] | None:
    found = [(name, cells[cell]["inputs_s"]) for name, cells in r["systems"].items() if name.startswith(prefix)]
    return max(found, key=lambda f: f[1]) if found else None


def _ratios(r: dict) -> list[str]:
    pairs = [("inferd runtime", "sentence-transformers"), ("inferd server", "infinity-emb")]
    lines = ["## Ratios of inputs/s: ours over the best peer configuration in each cell", "",
             "| | " + " | ".join(f"{length} {b}" for length in ("short", "long") for b in SIZES) + " |",
             "|---|" + "---|" * (2 * len(SIZES))]
    for ours, peer in pairs:
        cells = []
        for length in ("short", "long"):
            for b in SIZES:
                mine, theirs = _best(r, ours, f"{length}/{b}"), _best(r, peer, f"{length}/{b}")
                cells.append(f"{mine[1] / theirs[1]:.2f}x" if mine and theirs else "-")
        lines.append(f"| {ours} / {peer} | " + " | ".join(cells) + " |")
    return lines + [""]


def _cost(r: dict) -> list[str]:
    cores, price = r["machine"]["cores"], r["core_hour_usd"]
    lines = ["## Cost per million embedded tokens", "",
             f"USD per Mtok = core-hour price x cores x seconds per Mtok / 3600 = {price} x {cores} x "
             "(1e6 / tokens per s) / 3600, at each system's best client batch size; tokens per s = inputs per s x "
             "mean tokens per input.", "", "| | short tokens/s | short USD/Mtok | long tokens/s | long USD/Mtok |",
             "|---|---|---|---|---|"]
    for name, cells in r["systems"].items():
        row = []
        for length in ("short", "long"):
            tokens_s = max(cells[f"{length}/{b}"]["inputs_s"] for b in SIZES) * r["mean_tokens"][length]
            row += [f"{tokens_s:,.0f}", f"{price * cores * 1e6 / tokens_s / 3600:.4f}"]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines + [""]
