"""The C++ kernels, built at install: one extension module per x86-64 family (inferd/kernels/variants.py).

INFERD_KERNEL_ISAS picks which: `all` (the default, for a wheel that runs anywhere), `host` (those this CPU runs:
`make install`) or a comma-separated list. A machine that cannot build them (no compiler) still installs inferd,
which then runs torch's ops: one line says so.
"""
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from inferd.kernels import variants  # noqa: E402  (imports nothing else of inferd, nor torch)


def chosen() -> list[str]:
    spec = os.environ.get("INFERD_KERNEL_ISAS", "all")
    if spec == "all":
        return list(variants.VARIANTS)
    if spec == "host":
        return variants.runnable(variants.host_flags())
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in variants.VARIANTS]
    if unknown:
        sys.exit(f"INFERD_KERNEL_ISAS: unknown variant(s) {', '.join(unknown)}; expected all, host or some of "
                 f"{', '.join(variants.VARIANTS)}")
    return names


def extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # metadata only (an sdist, or pip asking for the build's requirements)
        return [], {}

    class BuildKernels(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as e:
                _skipped("", e)

        def build_extension(self, ext):
            # a folder per variant that outlives the build (pip's editable build picks a temporary one), so that
            # ninja recompiles only what changed: pip install -e . again, make kernels
            self.build_temp = os.path.join(ROOT, "build", "kernels", ext.name.rsplit("_C_", 1)[-1])
            try:
                super().build_extension(ext)
            except Exception as e:
                _skipped(ext.name, e)

    sources = [os.path.join("inferd", "kernels", "csrc", name) for name in variants.SOURCES]
    modules = [CppExtension(f"inferd.kernels._C_{name}", sources,
                            extra_compile_args=[*variants.COMMON_FLAGS, *variants.VARIANTS[name][1]],
                            extra_link_args=["-fopenmp"])
               for name in chosen()]
    return modules, {"build_ext": BuildKernels.with_options(use_ninja=True)}


def _skipped(name: str, e: Exception) -> None:
    last = (str(e).strip().splitlines() or [""])[-1]
    print(f"inferd: C++ kernels{' ' + name if name else ''} not built ({type(e).__name__}: {last}); "
          "torch's ops serve instead", file=sys.stderr)


modules, commands = extensions()
setup(ext_modules=modules, cmdclass=commands)
