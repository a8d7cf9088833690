import base64
import html
import io

import numpy as np

from inferd.bench.client import RequestRecord

FIGSIZE = (7.5, 3.2)
BIN_S = 1.0


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _done(plt, fig, ax) -> str:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    png = _png(fig)
    plt.close(fig)
    return png


# plots

def latency_vs_load(report: dict) -> str:
    plt, fig, ax = _figure("Latency vs offered load", "offered rate (req/s)", "ms")
    rates = [p["rate_per_s"] for p in report["points"]]
    for key, pct in (("ttft_ms", "p50"), ("ttft_ms", "p95"), ("ttft_ms", "p99"), ("tpot_ms", "p95"),
                     ("e2e_ms", "p95")):
        values = [p["summary"]["latency"][key][pct] for p in report["points"]]
        ax.plot(rates, [np.nan if v is None else v for v in values], marker="o", label=f"{key[:-3]} {pct}")
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        if (bound := report["slo"].get(key)) is not None:
            ax.axhline(bound, linestyle="--", linewidth=1, color="grey")
    if (cap := report["capacity"]["rate_per_s"]) is not None:
        ax.axvline(cap, color="green", linewidth=1, label="capacity")
    ax.set_yscale("log")
    return _done(plt, fig, ax)


def distribution(values_ms: list[float], title: str) -> str:
    plt, fig, ax = _figure(title, "ms", "samples")
    if values_ms:
        rounded = np.round(values_ms, 6)  # identical-but-for-rounding values would leave no room for 50 bins
        ax.hist(rounded, bins=min(50, len(set(rounded.tolist()))))
    return _done(plt, fig, ax)


def throughput_over_time(records: list[RequestRecord]) -> str:
    plt, fig, ax = _figure("Throughput over time", "s since start", "output chunks/s (≈ tokens/s)")
    chunks = [r.sent_s + t for r in records for t in r.chunk_s]
    ends = [r.sent_s + r.done_s for r in records if r.outcome == "completed" and r.done_s is not None]
    if chunks:
        edges = np.arange(0.0, max(chunks) + 2 * BIN_S, BIN_S)
        ax.plot(edges[:-1], np.histogram(chunks, edges)[0] / BIN_S, label="output chunks/s")
        requests = ax.twinx()
        requests.plot(edges[:-1], np.histogram(ends, edges)[0] / BIN_S, color="tab:orange", label="completed/s")
        requests.set_ylabel("completed requests/s")
        fig.legend(fontsize=8, loc="upper right")
    return _done(plt, fig, ax)


def queue_over_time(records: list[RequestRecord], gauges: list[list]) -> str:
    plt, fig, ax = _figure("Queue depth over time", "s since start", "requests")
    if gauges:
        t = [g[0] for g in gauges]
        ax.step(t, [np.nan if g[2] is None else g[2] for g in gauges], where="post", label="server waiting")
        ax.step(t, [np.nan if g[1] is None else g[1] for g in gauges], where="post", label="server running")
    spans = [(r.sent_s, r.sent_s + (r.done_s or 0.0)) for r in records]
    if spans:
        grid = np.linspace(0.0, max(e for _, e in spans), 200)
        ax.plot(grid, [sum(s <= x < e for s, e in spans) for x in grid], label="client in flight", alpha=0.7)
    return _done(plt, fig, ax)


# page

def html_page(report: dict, markdown_text: str, records: list[RequestRecord], gauges: list[list]) -> str:
    """One self-contained page: the Markdown summary and the plots as base64 PNGs."""
    done = [r for r in records if r.outcome == "completed"]
    images = [latency_vs_load(report)] if report["kind"] == "sweep" else []
    images += [distribution([r.ttft_s * 1e3 for r in done if r.ttft_s is not None], "TTFT distribution"),
               distribution([g * 1e3 for r in done for g in r.itl_s], "Inter-token latency distribution"),
               throughput_over_time(records), queue_over_time(records, gauges)]
    body = "\n".join(f'<img src="data:image/png;base64,{png}">' for png in images)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>inferd bench</title></head><body>"
            f"<pre style='white-space:pre-wrap'>{html.escape(markdown_text)}</pre>{body}</body></html>\n")
