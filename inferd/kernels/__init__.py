"""The CPU kernels: C++ in csrc/ built as one module (build.py), their Python face and torch versions (ops.py).
Imports nothing else of inferd."""
