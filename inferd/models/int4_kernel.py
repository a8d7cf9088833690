"""Q4_1 linears: bf16 rows on AVX-512 VNNI and float32 rows on AVX2 (the weights multiplied as integers by inputs
rounded to 16 bits a group), and either rounded to int8 (bf16 rows on AVX-512 VNNI, float32 rows on AVX2). One
layout for all; the loops are inferd/kernels/csrc/int4.cpp, their measurements docs/kernels.md.

Layout (`pack_panels`): panels of 16 output channels; in each, groups of 32 weights along K as 256 bytes of
nibbles, ordered so that one 32-byte load widened to 16 bits holds two dot-product operands (a lane of two words
adds the products of a pair of inputs to one output): byte i of chunk c holds, low nibble, the weight of output
i / 2 at input 2 c + i % 2 of the group, high nibble the one at input 2 (c + 8) + i % 2. Each group's d and m stay
fp16, as a Q4_1 file stores them, 64 bytes beside its 256: 5 bits a weight, the file's own size, and
y = sum_g d_g (q . x)_g + m_g (sum of x)_g.

bf16 rows (AVX-512 BF16 and VNNI): the float32 rows' arithmetic below on 512-bit registers, vpdpwssd adding a
lane's two products of nibble and 16-bit input to it: the file's weights times the inputs rounded to 16 bits a
group, exactly up to float32 sums. Several accumulators per row keep the products' latency hidden. Up to 8 rows
share each widened weight; more rows run in tiles of at most 8, as even as possible, over the same panel.

float32 rows (AVX2, where bf16 is emulated and slow): each group of 32 inputs is rounded to 16-bit integers on its
own scale (its largest |x| to 32767: an input moves by at most 1/65534 of that, where rounding it to bf16 moves it
by up to 1/512 of itself), and vpmaddwd multiplies them by the nibbles widened to 16 bits, two products a lane summed
exactly in 32 bits: no nibble is converted to float. Up to 4 rows share each widened weight.

int8 inputs (`int4_linear_int8`; inferd.kernels.select says from how many rows): each row rounded to int8 a group
of 32 on its own scale (llama.cpp multiplies Q4_1 by Q8_1 so). bf16 rows (AVX-512 VNNI and BF16): vpdpbusd adds
four products of nibble and int8 input a lane, exactly in 32 bits: no nibble is widened. One word permute puts 64
bytes of the layout above in lane order (lane j: output j's nibbles at four inputs in a row). The m term takes the
rounded inputs' sum, so that their rounding errors meet the weights d q + m, centred on 0. float32 rows (AVX2):
each panel spread once to bytes (the nibbles of a chunk's two halves interleaved a word at a time), vpmaddubsw
multiplies 32 nibbles by 32 int8 inputs into 16 words, a group's 8 chunks add up in 16 bits (at most 30,480) and
vpmaddwd widens them.

Panels are split across the threads.
"""

import torch

from inferd.kernels.variants import load_kernels

GROUP = 32  # weights per (d, m) pair along K, as in Q4_1
PANEL = 16  # output channels per panel: one AVX-512 register of float32

def load_int4_kernel(isa: str = "native"):
    """The compiled kernels (inferd.kernels) where there are some here (AVX2 and up), else None (torch's int4
    kernel serves bf16 rows). Their bf16 rows need AVX-512 BF16 (`int4_linear_bf16_native()`). `isa` other than
    this CPU's best variant is for tests and benchmarks: "avx2" runs the AVX2 loops alone on an AVX-512 machine."""
    module = load_kernels(isa)
    return module if module is not None and module.int4_linear_fp32_native() else None


def pack_panels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (0..15), d and m [N, K / 32] -> the kernel's nibbles uint8 [P, G, 8, 32] and its d and m
    fp16 [P, G, 2, 16], N padded to P * 16 with zero rows."""
    n, k = q.shape
    panels, groups = -(-n // PANEL), k // GROUP
    padded = torch.zeros(panels * PANEL, k, dtype=torch.uint8)
    padded[:n] = q
    pairs = padded.view(panels, PANEL, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(panels, groups, 16, 32)
    nibbles = (pairs[:, :, :8] | (pairs[:, :, 8:] << 4)).contiguous()
    dm = torch.zeros(panels * PANEL, groups, 2)
    dm[:n, :, 0], dm[:n, :, 1] = d, m
    return nibbles, dm.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous().half()
