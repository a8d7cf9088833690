"""The CPU rules under INFERD_KERNEL_MARCH: another machine's code run here picks what that machine would."""
import shutil

import pytest

from inferd.models import cpu


@pytest.fixture
def march(monkeypatch):
    def set_march(value: str) -> frozenset[str]:
        monkeypatch.setenv("INFERD_KERNEL_MARCH", value)
        return cpu.cpu_flags()
    return set_march


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to ask what a -march has")
def test_an_avx2_march_hides_the_avx512_and_amx_flags_from_the_rules(march):
    native = march("native")
    haswell = march("haswell")
    assert haswell <= native
    assert not {"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"} & haswell
    assert {"avx2", "fma"} & native == {"avx2", "fma"} & haswell  # what haswell has stays as the CPU has it
    assert not cpu.has_native_bf16() and cpu.int4_int8_rows() is None and cpu.int4_max_rows(True) == 1
    assert cpu.int4_int8_rows(True) == 4 and cpu.int4_max_rows(True, True) is None  # float32 rows: AVX2 loops
    assert cpu.auto_quantization("auto") == "int4"  # with float32 rows, as on an AVX2 machine
    march("native")  # float32 rows: dense from 193 rows where oneDNN has AVX-512 FMAs, never on AVX2 alone
    assert cpu.int4_max_rows(True, True) == (192 if "avx512f" in native else None)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_a_build_for_another_march_is_never_handed_out_as_this_cpus(march):
    """The loaders cache per -march built (cpu.per_march): a test or benchmark that sets INFERD_KERNEL_MARCH gets that
    build, and the rest of the process this CPU's own again once it is unset (a cache keyed on "native" kept
    whichever came first)."""
    from inferd.models.cpu_kernels import load_cpp_kernels
    march("haswell")
    avx2 = load_cpp_kernels()
    assert avx2 is not None and avx2 is load_cpp_kernels("haswell")
    march("native")
    assert load_cpp_kernels() is not avx2


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_every_cpp_module_builds_where_a_compiler_is(monkeypatch):
    """A module that does not build serves its torch fallback, and its own tests skip ("no C++ toolchain here"): a
    compile error would pass unseen. Where a compiler is, each must build (on CPUs with AVX2, as every x86 these
    days has; the int8 and int4 kernels need it)."""
    from inferd.models.cpu_kernels import load_cpp_kernels
    from inferd.models.decode_loop import load_decode_loop
    from inferd.models.int4_kernel import load_int4_kernel
    from inferd.models.quant import load_int8_kernel

    monkeypatch.delenv("INFERD_NO_CPP_KERNELS", raising=False)
    assert load_cpp_kernels() is not None
    assert load_decode_loop() is not None
    if {"avx2", "fma"} <= cpu.cpu_flags():
        assert load_int8_kernel() is not None
        assert load_int4_kernel() is not None
