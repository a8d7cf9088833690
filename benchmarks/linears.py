"""All of SmolLM2's linear layers (30 x qkv, o, gate_up, down + lm_head, fp32) at batch M:
F.linear against the same weights prepacked once for oneDNN (inferd.models.packed). Then, where the C++ ops
have their one-row loop (AVX-512 BF16), the same layers in bf16 at one row: oneDNN's prepacked product against
`one_row_linear` on the weights in pairs (inferd.models.packed.PackedLinear's one_row), as read bandwidth (weight
bytes / time; 267 MB a pass, so the weights come from memory as in a decode step), 3 rounds taking turns.

    PYTHONPATH=. .venv/bin/python benchmarks/linears.py
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
    one_row_bf16()


def one_row_bf16() -> None:
    from inferd.kernels.variants import load_kernels
    from inferd.models.packed import pair_weights

    ops = load_kernels()
    if ops is None or not ops.one_row_linear_native():
        print("no one-row loop here (needs AVX-512 BF16)")
        return
    weights = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH) for w in weights]
    pairs = [pair_weights(w) for w in weights]
    x = {k: torch.randn(1, k).to(torch.bfloat16) for k in (576, 1536)}
    linear, none = torch.ops.mkldnn._linear_pointwise, torch.empty(0)
    gb = sum(w.nbytes for w in weights) / 1e9
    runs = {"oneDNN prepacked": [], "one_row_linear": []}
    for _ in range(3):
        runs["oneDNN prepacked"].append(timed_ms(lambda: [linear(x[w.shape[1]], p, None, "none", [None], "")
                                                          for w, p in zip(weights, packed)]))
        runs["one_row_linear"].append(timed_ms(lambda: [ops.one_row_linear(x[p.shape[1] * 2], p, none)
                                                        for p in pairs]))
    print("\nbf16, one row, all 121 linears: | | ms | GB/s |\n|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {statistics.median(r):.2f} | {gb / statistics.median(r) * 1e3:.1f} |")
    print(f"one_row_linear / oneDNN: {statistics.median(runs['oneDNN prepacked']) / statistics.median(runs['one_row_linear']):.2f}x")


if __name__ == "__main__":
    main()
