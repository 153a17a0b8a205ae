#!/usr/bin/env bash
# What runs on the GPU machine (no MLIR there: only the runtime, from .gpu/, built here by
# bench/gpu_build.sh). With the device tool: carry .gpu, run `bash .gpu/bench/gpu_run.sh $OUT PART`.
#   part 1: machine, runtime tests (Python 3.12, no MLIR), GPU suite, examples, crafted files
#   part 2: benchmarks (linear vs cuBLAS and numpy, thread scaling, MLP call path vs torch)
#   part 3: the GPU suite, the tilings sweep (built with TUNE=1), linear vs cuBLAS, MLP (profiled)
set -uo pipefail
out=${1:-/tmp/hexir-gpu}; part=${2:-1}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD/runtime PYTHONUNBUFFERED=1
status=0
if [ "$part" = 1 ]; then
  { echo "== machine"; nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader; nproc
    python3 -c "import sys, numpy, torch, cuda.bindings; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
    echo "== runtime tests (Python 3.12, no MLIR; the torch/cupy DLPack tests need this GPU)"
    (cd tests && python3 -m pytest runtime -q -p no:cacheprovider -o addopts="" -rfs 2>&1 | tail -15)
  } 2>&1 | tee "$out/machine.txt"
  echo "== GPU property suite: cuda vs cpu vs numpy"
  python3 tests/gpu/suite.py run cases --devices cuda,cpu 2>&1 | tee "$out/suite.txt" || status=1
  echo "== split example (cuda linear, cpu relu + biased linear)"
  (cd example && python3 -m hexir_runtime split.hxb --device=cuda --input x=split_x.npy) 2>&1 | tee "$out/split.txt" || status=1
  echo "== custom kernel example (relu6.cu between two generated linears)"
  (cd example && python3 -m hexir_runtime custom.hxb --device=cuda --input x=x.npy --output y.npz --quiet \
    && python3 -c "import numpy as n; y=n.load('y.npz')['output0']; e=n.load('expected.npy'); \
print('custom.hxb on cuda: max abs difference from numpy', float(abs(y-e).max())); assert n.allclose(y, e, rtol=1e-4, atol=1e-4)") \
    2>&1 | tee "$out/custom.txt" || status=1
  echo "== crafted cuda modules"
  python3 bench/crafted.py run crafted cuda 2>&1 | tee "$out/crafted.txt" || status=1
elif [ "$part" = 3 ]; then
  echo "== GPU property suite: cuda vs cpu vs numpy"
  python3 tests/gpu/suite.py run cases --devices cuda,cpu 2>&1 | tail -12 | tee "$out/suite.txt" || status=1
  echo "== the tilings sweep (bench/tilings.py) vs cuBLAS"
  python3 bench/linear.py run variants --device cuda --repeats 20 2>&1 | tee "$out/tilings.txt" || status=1
  echo "== linear on cuda vs cuBLAS"
  python3 bench/linear.py run modules --device cuda --repeats 20 2>&1 | tee "$out/linear_cuda.txt" || status=1
  echo "== MLP call path vs torch eager, the one-kernel call profiled"
  python3 bench/mlp.py run bench/mlp_modules.tar.gz --profile 2>&1 | tee "$out/mlp_cuda.txt" || status=1
else
  echo "== linear on cuda vs cuBLAS"
  python3 bench/linear.py run modules --device cuda --repeats 20 2>&1 | tee "$out/linear_cuda.txt" || status=1
  echo "== linear on the host cpu vs numpy ($(nproc) cores)"
  python3 bench/linear.py run modules --device cpu --repeats 5 --max-gflop 40 2>&1 | tee "$out/linear_cpu.txt" || status=1
  echo "== thread scaling (hexir and numpy on as many threads)"
  for t in 1 2 4 8 16; do python3 bench/linear.py run modules --device cpu --repeats 5 --threads $t \
    --sizes 512x512x512,1024x1024x1024,2048x2048x2048,16x4096x4096 2>&1; done \
    | tee "$out/linear_cpu_threads.txt" || status=1
  echo "== MLP call path vs torch eager"
  python3 bench/mlp.py run bench/mlp_modules.tar.gz 2>&1 | tee "$out/mlp_cuda.txt" || status=1
  python3 bench/mlp.py run bench/mlp_modules.tar.gz --device cpu 2>&1 | tee "$out/mlp_cpu.txt" || status=1
fi
exit $status
