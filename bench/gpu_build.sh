#!/usr/bin/env bash
# Build, here (MLIR needed), everything bench/gpu_run.sh runs on the GPU machine, into .gpu/
# (ignored by git; carry it with the device tool): the runtime and its tests as they are now,
# the GPU suite's cases (linear and op-family), the benchmarks' modules, the examples.
#   bash bench/gpu_build.sh             everything (parts 1, 2, 3 and h23)
#   ONLY=h23 bash bench/gpu_build.sh    what part h23 needs: runtime, its tests, the suite's cases,
#                                       the GEMMs before/after, the epilogue and ops modules
#   ONLY=h24 bash bench/gpu_build.sh    what part h24 needs: runtime, its tests, the suite's cases (20 drawn),
#                                       the transformer (tests/gpu/sequence.py), the ops and block benches
#   ONLY=r7 bash bench/gpu_build.sh     what part r7 needs (round 7: #25, #26): runtime, its tests, the suite's cases
#                                       (EXAMPLES drawn, 10), the transformer, the block, the MLP in bf16, the
#                                       tensor-core linears, fused attention
#   ONLY=h29 bash bench/gpu_build.sh    what part h29 needs (issue #29, ~1 MB): the runtime, bench/linear.py,
#                                       the cpu linears with w an argument and their schedule variants
#   EXAMPLES=N                          the linear cases hypothesis draws beside the fixed ones (60)
# Seen on 2026-12-01 on this machine's 2 cores under a load of ~12 (wall, CPU): the op-family
# cases (26 modules) 21 min, 4.5 min; GEMMs before 2.6 min, 0.5; after + epilogues 12 min, 1.6;
# ops modules 3 min, 0.5. Idle, the CPU minutes are about the wall minutes.
# "before" is the compiler of $BEFORE_REF (default main), from a worktree at $BEFORE (default
# /work/wt/h23-before, added detached if missing), run with its own PYTHONPATH; "after" is this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
export HEXIR_CACHE_DIR= PYTHONPATH=runtime:.   # never a cached module: the build is the compiler as it is
ONLY=${ONLY:-all} BEFORE=${BEFORE:-/work/wt/h23-before} BEFORE_REF=${BEFORE_REF:-main}
if [ "$ONLY" = h24 ]; then  # issue #24 (and #25's memory-bound ops and block): no GEMMs before/after
  rm -rf .gpu && mkdir -p .gpu/tests .gpu/bench .gpu/examples
  cp -r runtime docs .gpu/ && cp -r tests/runtime tests/data tests/gpu .gpu/tests/ && cp examples/transformer.py .gpu/examples/
  cp bench/ops.py bench/block.py bench/gpu_run.sh .gpu/bench/
  find .gpu -name __pycache__ -prune -exec rm -rf {} +
  python tests/gpu/suite.py build .gpu/cases --examples "${EXAMPLES:-20}"
  python tests/gpu/sequence.py build .gpu/sequence
  python bench/ops.py build .gpu/ops
  python bench/block.py build .gpu/block
  ls .gpu; du -sh .gpu; exit 0
fi
if [ "$ONLY" = r7 ]; then  # round 7: 16-bit dtypes and tensor cores (#26), fused attention and the block (#25)
  rm -rf .gpu && mkdir -p .gpu/tests .gpu/bench .gpu/examples
  cp -r runtime docs .gpu/ && cp -r tests/runtime tests/data tests/gpu .gpu/tests/ && cp examples/transformer.py .gpu/examples/
  cp bench/block.py bench/mlp.py bench/linear.py bench/attention.py bench/gpu_run.sh .gpu/bench/
  find .gpu -name __pycache__ -prune -exec rm -rf {} +
  python tests/gpu/suite.py build .gpu/cases --examples "${EXAMPLES:-10}"
  python tests/gpu/sequence.py build .gpu/sequence
  python bench/block.py build .gpu/block
  python bench/mlp.py build .gpu/bench/mlp_bf16 --bf16 && rm -rf .gpu/bench/mlp_bf16
  python bench/linear.py build .gpu/tc --tensor-cores && rm -rf .gpu/tc
  python bench/attention.py build .gpu/attention
  (cd .gpu && tar cJf cases.tar.xz cases && rm -rf cases)  # (42 MB -> a few: the tree travels in 64 MiB)
  ls .gpu; du -sh .gpu; exit 0
fi
if [ "$ONLY" = h29 ]; then  # issue #29 alone: the runtime, bench/linear.py and the cpu linears (~1 MB)
  sizes=512x512x512,1024x1024x1024,2048x2048x2048,64x784x512
  rm -rf .gpu && mkdir -p .gpu/bench && cp -r runtime .gpu/ && cp bench/linear.py bench/gpu_run.sh .gpu/bench/
  find .gpu -name __pycache__ -prune -exec rm -rf {} +
  python bench/linear.py build .gpu/h29/modules --device cpu --sizes $sizes
  python bench/linear.py build .gpu/h29/variants --device cpu --sizes $sizes --symbolic \
    --variants pertile,packed,pertile_x,packed_x,packed_kc128,stream64
  rm -rf .gpu/h29/modules .gpu/h29/variants  # (they travel packed: linear.py run unpacks them there)
  ls -l .gpu/h29; du -sh .gpu; exit 0
fi
rm -rf .gpu && mkdir -p .gpu/tests .gpu/bench .gpu/example
cp -r runtime docs .gpu/ && cp -r tests/runtime tests/data .gpu/tests/ && cp -r tests/gpu .gpu/tests/
cp bench/linear.py bench/mlp.py bench/crafted.py bench/gemm_compare.py bench/ops.py bench/gpu_run.sh .gpu/bench/
find .gpu -name __pycache__ -prune -exec rm -rf {} +
python tests/gpu/suite.py build .gpu/cases --examples "${EXAMPLES:-60}"  # the linear cases hypothesis draws
# the GEMMs: before (the compiler of $BEFORE_REF) and after (this tree), and the epilogues (after)
[ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" "$BEFORE_REF"
git -C "$BEFORE" log --oneline -1 | sed 's/^/before: /'
(cd "$BEFORE" && PYTHONPATH="$BEFORE/runtime:$BEFORE" python "$OLDPWD/bench/gemm_compare.py" build "$OLDPWD/.gpu/gemm/before")
python bench/gemm_compare.py build .gpu/gemm/after --epilogues
python bench/ops.py build .gpu/ops
if [ "$ONLY" != h23 ]; then
  python bench/linear.py build .gpu/modules
  python bench/mlp.py build .gpu/bench/mlp_modules && rm -rf .gpu/bench/mlp_modules  # the tests find it there too
  python bench/crafted.py build .gpu/crafted
  python examples/split.py .gpu/example > /dev/null
  python examples/custom_kernel/run.py .gpu/example > /dev/null
  if [ "${TUNE:-0}" = 1 ]; then python bench/tilings.py .gpu/variants; fi  # part 3's sweep
fi
ls .gpu; du -sh .gpu
