// The parts of ATen the kernels use, not torch/extension.h: that one brings autograd, nn, pybind11 and Python's
// headers, and parsing it took several times as long as each kernel file's own code (benchmarks/README.md,
// "The kernels' build"); only bindings.cpp includes it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
