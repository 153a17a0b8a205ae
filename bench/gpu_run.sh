#!/usr/bin/env bash
# What runs on the GPU machine (no MLIR there: only the runtime, from .gpu/, built here by
# bench/gpu_build.sh). With the device tool: carry .gpu, run `bash .gpu/bench/gpu_run.sh $OUT PART`.
#   part 1: machine, runtime tests (Python 3.12, no MLIR), GPU suite, examples, crafted files
#   part 2: benchmarks (linear vs cuBLAS and numpy, thread scaling, MLP call path vs torch)
#   part 3: the GPU suite, the tilings sweep (built with TUNE=1), linear vs cuBLAS, MLP (profiled)
#   part h23 (issue #23, one call, ~6-8 min; `ONLY=h23 bash bench/gpu_build.sh` builds what it needs),
#     each also a part of its own:
#     machine  GPU, versions, runtime tests (~1 min)                                  -> machine.txt
#     suite    GPU ≡ CPU suite: linear cases and every registered op / fused chain
#              / long row, cuda vs cpu vs numpy (~1-2 min)                             -> suite.txt
#     gemm     GEMMs before/after (main's compiler vs this tree's, in turns) with
#              after/before, and linear 4096^3 + gelu/gelu_tanh/silu/bias+gelu vs
#              the plain linear (#23's target: <= 1.03) (~1 min)                       -> gemm.txt
#     ops      softmax, layer_norm, gelu(x*a+b) vs a copy of the bytes, torch eager,
#              torch.compile (at most ~2 min of compiling) on cuda, vs numpy on the
#              cpu (~3-4 min)                                                          -> ops.txt
#   part h24a (#24, ~4 min): machine, suite (every family incl. matmul and layout), sequence (the
#     transformer on cuda and cpu vs numpy and torch)             -> machine.txt, suite.txt, sequence.txt
#   part h24b (#25, ~6 min): ops (memory-bound kernels vs copy, torch, torch.compile), block (a
#     transformer block vs torch eager and torch.compile)        -> ops.txt, block.txt
#   part r7 (round 7, ~6 min; `ONLY=r7 bash bench/gpu_build.sh`): machine, suite (16-bit cases, fused
#     attention), sequence (the transformer, fused attention), block, the MLP in bf16 vs torch eager bf16,
#     the tensor-core linears (bf16/f16/TF32) vs cuBLAS, fused attention vs SDPA (or as two calls:
#     r7a = machine, suite, sequence; r7b = block and the rest)
#                                            -> machine.txt, suite.txt, sequence.txt, block.txt, r7.txt
#   part h29 (issue #29, one call, ~6-8 min; `ONLY=h29 bash bench/gpu_build.sh` builds what it needs):
#     the cpu linear with w an argument (512^3-2048^3, 64x784x512, f32 and f64) on the host's
#     cores: the kernel vs np.matmul(out=) and the user's call vs x @ w, three passes side by side
#     (then one pass with fresh output arrays, RECYCLE off); then the schedule's variants (w
#     packed per tile / once per call, x copied per tile, KC 128, 64 rows streamed, a symbolic batch) in turns with
#     twins, each also on 64-byte aligned buffers ("@64B"), three passes            -> h29.txt
#   Exit status 0 only if each part ran and nothing printed FAIL or WRONG.
set -uo pipefail
out=${1:-/tmp/hexir-gpu}; part=${2:-1}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD/runtime PYTHONUNBUFFERED=1
status=0
run_machine() {
  { echo "== machine"; nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.max.sm --format=csv,noheader; nproc
    python3 -c "import sys, numpy, torch, cuda.bindings; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
    echo "== runtime tests (Python 3.12, no MLIR; the torch/cupy DLPack tests need this GPU)"
    (cd tests && python3 -m pytest runtime -q -p no:cacheprovider -o addopts="" -rfs 2>&1 | grep -v "^SKIPPED" | tail -15)
  } 2>&1 | tee "$out/machine.txt"
}
run_suite() {
  [ -f cases.tar.xz ] && [ ! -d cases ] && tar xJf cases.tar.xz  # (r7: the cases travel packed)
  echo "== GPU property suite: cuda vs cpu vs numpy (linear cases, then the op families)"
  python3 tests/gpu/suite.py run cases --devices cuda,cpu 2>&1 | tee "$out/suite.txt" | tail -60 || status=1
}
run_gemm() {
  echo "== GEMMs before/after, and linear + epilogue vs plain linear"
  python3 bench/gemm_compare.py run gemm --repeats 30 2>&1 | tee "$out/gemm.txt" || status=1
}
run_ops() {
  echo "== memory-bound ops: cuda vs a copy, torch eager, torch.compile; cpu vs numpy"
  { python3 bench/ops.py run ops --device cuda --compile --compile-budget 120
    python3 bench/ops.py run ops --device cpu --repeats 8; } 2>&1 | tee "$out/ops.txt" || status=1
}
run_sequence() {
  echo "== #24: the transformer at seq 1, 7, 129, 1000 on cuda and the cpu vs numpy and torch; 20 tokens on cuda"
  python3 tests/gpu/sequence.py run sequence --torch 2>&1 | tee "$out/sequence.txt" || status=1
}
run_block() {
  echo "== #25: a transformer block (8 x 512 x 768) vs torch eager and torch.compile"
  python3 bench/block.py run block 2>&1 | tee "$out/block.txt" || status=1
}
run_h29() {
  { echo "== #29: cpu linear, w an argument, $(nproc) cores: kernel vs np.matmul(out=), call vs x @ w, 3 passes"
    python3 -c "import sys, numpy; print('python', sys.version.split()[0], 'numpy', numpy.__version__)"
    cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null | sed 's/^/transparent hugepages: /'
    python3 bench/linear.py run h29/modules.tar.xz --device cpu --passes 3 --repeats 12
    echo "== #29: the same, one pass, each call's output a fresh np.empty (RECYCLE off)"
    python3 bench/linear.py run h29/modules.tar.xz --device cpu --repeats 12 --fresh-outputs
    echo "== #29: the schedule's variants in turns (twins), 3 passes"
    python3 bench/linear.py run h29/variants.tar.xz --device cpu --interleave --aligned --passes 3 --repeats 7
  } 2>&1 | tee "$out/h29.txt" || status=1
}
run_r7() {
  { echo "== #26: the MLP in bfloat16 (sm_90 + sm_90a images) vs torch eager in bfloat16"
    python3 bench/mlp.py run bench/mlp_bf16.tar.gz --repeats 200
    echo "== #26: tensor-core linears vs cuBLAS (torch.matmul in the same dtype; TF32 allowed for the TF32 rows)"
    python3 bench/linear.py run tc.tar.xz --device cuda --repeats 10
    echo "== #25: fused attention vs torch SDPA (f32, TF32 off)"
    python3 bench/attention.py run attention --repeats 20
  } 2>&1 | tee "$out/r7.txt" || status=1
}
case "$part" in
  r7) run_machine; run_suite; run_sequence; run_block; run_r7
      grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  r7a) run_machine; run_suite; run_sequence  # (r7 in two calls of under 10 minutes)
       grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  r7b) run_block; run_r7
       grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  h29) run_h29; grep -l "FAIL\|WRONG" "$out"/h29.txt && status=1; exit $status ;;
  h24a) run_machine; run_suite; run_sequence
        grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  h24b) run_ops; run_block
        grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  sequence|block) "run_$part"; exit $status ;;
  h23) run_machine; run_suite; run_gemm; run_ops
       grep -l "FAIL\|WRONG" "$out"/*.txt && status=1; exit $status ;;
  machine|suite|gemm|ops) "run_$part"; exit $status ;;
esac
if [ "$part" = 1 ]; then
  { echo "== machine"; nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader; nproc
    python3 -c "import sys, numpy, torch, cuda.bindings; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
    echo "== runtime tests (Python 3.12, no MLIR; the torch/cupy DLPack tests need this GPU)"
    (cd tests && python3 -m pytest runtime -q -p no:cacheprovider -o addopts="" -rfs 2>&1 | grep -v "^SKIPPED" | tail -15)
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
