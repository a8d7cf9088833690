"""Which build of the kernels a CPU runs, and what the rules see under INFERD_KERNEL_ISA: another machine's code run
here picks what that machine would. The CPUs' flags are injected, so every case runs on any machine."""
import shutil

import pytest

from inferd.kernels import variants
from inferd.kernels import select

V3 = "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave sse4_2"
SKYLAKE_X = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
ZEN4 = SKYLAKE_X + " avx512_vnni avx512_bf16 avx512vbmi"
SAPPHIRE_RAPIDS = ZEN4 + " amx_tile amx_bf16 amx_int8 avx512_fp16"
CPUS = {  # flags -> the variants it runs
    "sse4_2 avx": [],
    "avx avx2 fma f16c": [],  # x86-64-v3 needs BMI, LZCNT and MOVBE too
    V3: ["avx2"],
    SKYLAKE_X: ["avx2", "avx512"],
    V3 + " avx512f avx512_bf16": ["avx2"],  # AVX-512 without BW/VL/DQ: the AVX2 build
    ZEN4: ["avx2", "avx512", "avx512_bf16"],
    SAPPHIRE_RAPIDS: ["avx2", "avx512", "avx512_bf16", "amx"],
}


@pytest.mark.parametrize("flags,expected", CPUS.items())
def test_each_cpu_runs_the_variants_its_flags_cover_and_the_best_of_them(flags, expected):
    flags = frozenset(flags.split())
    assert variants.runnable(flags) == expected
    assert variants.best(flags) == (expected[-1] if expected else None)


@pytest.mark.parametrize("cap,best", [("avx2", "avx2"), ("avx512", "avx512"), ("avx512_bf16", "avx512_bf16"),
                                      ("amx", "amx")])
def test_a_cap_hides_the_instruction_sets_above_it_and_keeps_the_rest(cap, best):
    host = frozenset(SAPPHIRE_RAPIDS.split())
    seen = variants.cpu_flags(host, cap)
    assert variants.best(seen) == best
    assert seen >= {"sse4_2", "avx512vbmi", "avx512_fp16"}  # flags no variant needs are kept as the CPU has them
    assert seen == host - (variants.ISA_FLAGS - variants.VARIANTS[cap][0])


def test_the_rules_under_an_avx2_cap_pick_what_an_avx2_machine_would(monkeypatch):
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx2")
    flags = variants.cpu_flags()
    assert not {"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"} & flags
    if variants.best() is None:
        return  # this CPU has no AVX2: nothing to cap
    assert not select.native_bf16() and select.int4_rule("bfloat16", True) is None
    assert select.int4_rule("bfloat16", False) == (None, 1)  # torch's kernel for one row
    assert select.int4_rule("float32", True) == (4, None)  # float32 rows: the AVX2 loops at every row count
    assert select.auto_quantization("auto") == "int4"


def test_a_cap_that_names_no_variant_is_refused(monkeypatch):
    monkeypatch.setenv("INFERD_KERNEL_ISA", "haswell")
    with pytest.raises(ValueError, match="INFERD_KERNEL_ISA='haswell': expected one of avx2, avx512"):
        variants.cpu_flags()
    with pytest.raises(ValueError, match="unknown kernel variant 'sse'"):
        variants.load_kernels("sse")


def test_a_variant_this_cpu_cannot_run_is_never_loaded(monkeypatch):
    above = [name for name in variants.VARIANTS if name not in variants.runnable(variants.host_flags())]
    for name in above:
        assert variants.load_kernels(name) is None
    monkeypatch.setenv("INFERD_NO_CPP_KERNELS", "1")
    assert variants.load_kernels() is None


@pytest.mark.skipif(shutil.which("c++") is None or variants.best() is None,
                    reason="no compiler (the install built no kernels) or no AVX2 here")
def test_the_install_built_the_kernels_this_cpu_runs(monkeypatch):
    """setup.py lets the install go on where a variant does not build (torch's ops serve), so a compile error would
    pass unseen: where a compiler and AVX2 are, every variant this CPU runs must load, and a cap loads its own."""
    monkeypatch.delenv("INFERD_NO_CPP_KERNELS", raising=False)
    monkeypatch.delenv("INFERD_KERNEL_ISA", raising=False)
    built = {name: variants.load_kernels(name) for name in variants.runnable(variants.host_flags())}
    assert all(module is not None for module in built.values()), built
    assert variants.load_kernels() is built[variants.best()]
    assert built["avx2"].int4_linear_fp32_native() and not built["avx2"].int4_linear_bf16_native()
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx2")
    assert variants.load_kernels() is built["avx2"]
