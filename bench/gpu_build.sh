#!/usr/bin/env bash
# Build, here (MLIR needed), everything bench/gpu_run.sh runs on the GPU machine, into .gpu/
# (ignored by git; carry it with the device tool): the runtime and its
# tests as they are now, the GPU suite's cases, the benchmarks' modules, the examples.
set -euo pipefail
cd "$(dirname "$0")/.."
export HEXIR_CACHE_DIR= PYTHONPATH=runtime:.   # never a cached module: the build is the compiler as it is
rm -rf .gpu && mkdir -p .gpu/tests .gpu/bench .gpu/example
cp -r runtime docs .gpu/ && cp -r tests/runtime tests/data .gpu/tests/ && cp -r tests/gpu .gpu/tests/
cp bench/linear.py bench/mlp.py bench/crafted.py bench/gpu_run.sh .gpu/bench/
python tests/gpu/suite.py build .gpu/cases --examples 60
python bench/linear.py build .gpu/modules
python bench/mlp.py build .gpu/bench/mlp_modules && rm -rf .gpu/bench/mlp_modules  # the tests find it there too
python bench/crafted.py build .gpu/crafted
python examples/split.py .gpu/example > /dev/null
python examples/custom_kernel/run.py .gpu/example > /dev/null
if [ "${TUNE:-0}" = 1 ]; then python bench/tilings.py .gpu/variants; fi  # part 3's sweep
ls .gpu/example; du -sh .gpu
