#!/usr/bin/env bash
# What runs on the GPU machine (no MLIR there: only the runtime, from the tree). Built here by:
#   PYTHONPATH=runtime:. python tests/gpu/suite.py build bench/gpu_cases --examples 150
#   PYTHONPATH=runtime:. python bench/linear.py build bench/modules
#   (cd bench/gpu_cases/example && python ../../../examples/split.py)
#   python examples/custom_kernel/run.py && cp examples/custom_kernel/{custom.hxb,expected.npy} bench/gpu_cases/example/ && cp examples/custom_kernel/x.npy bench/gpu_cases/example/custom_x.npy
# Run there with the device tool, carrying bench/gpu_cases and bench/modules:
#   bash bench/gpu_run.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/hexir-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/runtime PYTHONUNBUFFERED=1
status=0
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
  python3 -c "import sys, numpy, cuda.bindings; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'cuda-bindings', cuda.bindings.__version__)"
  echo "== runtime tests (Python 3.12, no MLIR)"; python3 -m pytest tests/runtime -q -p no:cacheprovider -o addopts="" 2>&1 | tail -5
} 2>&1 | tee "$out/machine.txt"
echo "== GPU property suite: cuda vs cpu vs numpy"
python3 tests/gpu/suite.py run bench/gpu_cases --devices cuda,cpu 2>&1 | tee "$out/suite.txt" || status=1
echo "== split example on the GPU"
(cd bench/gpu_cases/example && python3 -m hexir_runtime split.hxb --device=cuda --input x=x.npy) 2>&1 | tee "$out/split.txt" || status=1
echo "== custom kernel example on the GPU (relu6.cu between two generated linears)"
(cd bench/gpu_cases/example && python3 -m hexir_runtime custom.hxb --device=cuda --input x=custom_x.npy --output y.npz --quiet \
  && python3 -c "import numpy as n; y=n.load('y.npz')['output0']; e=n.load('expected.npy'); \
print('custom.hxb on cuda: max abs difference from numpy', float(abs(y-e).max())); assert n.allclose(y, e, rtol=1e-4, atol=1e-4)") \
  2>&1 | tee "$out/custom.txt" || status=1
echo "== benchmark: linear on cuda vs cuBLAS"
python3 bench/linear.py run bench/modules --device cuda --repeats 10 2>&1 | tee "$out/bench_cuda.txt" || status=1
echo "== benchmark: linear on the host cpu vs numpy ($(nproc) cores)"
python3 bench/linear.py run bench/modules --device cpu --repeats 5 --max-gflop 20 2>&1 | tee "$out/bench_cpu.txt" || status=1
exit $status
