"""All of SmolLM2's linear layers (30 x qkv, o, gate_up, down + lm_head, fp32) at batch M:
F.linear against the same weights prepacked once for oneDNN (inferd.models.packed).

    python benchmarks/linears.py
"""
import statistics
import time

import torch

from inferd.models.packed import PACK_FOR_BATCH

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed_ms(fn, repeats: int = 5) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs)


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(s) for s in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH) for w in weights]
    linear = torch.ops.mkldnn._linear_pointwise
    print("| M | F.linear ms | prepacked oneDNN ms | speedup |\n|---|---|---|---|")
    for m in (1, 8, 32, 64, 256):
        x = {k: torch.randn(m, k) for k in (576, 1536)}
        plain = timed_ms(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights])
        ours = timed_ms(lambda: [linear(x[w.shape[1]], p, None, "none", [None], "") for w, p in zip(weights, packed)])
        print(f"| {m} | {plain:.1f} | {ours:.1f} | {plain / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
