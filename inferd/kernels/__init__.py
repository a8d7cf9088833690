"""The CPU kernels: C++ in csrc/, built at install once per x86-64 family (variants.py, setup.py), their Python
face and torch versions (ops.py). Imports nothing else of inferd."""
