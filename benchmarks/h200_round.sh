#!/usr/bin/env bash
# One device call's worth of GPU work: checks, timings against jla, a profile.
#
#   bash benchmarks/h200_round.sh GATE "PYTEST_K" "SHAPES..." ["IMPLS..."]
#
# Installs the carried wheels (.whl: jla, fla-core) into /tmp/site, then runs
# `pytest -m gpu -k PYTEST_K` (skipped when empty), benchmark.py for GATE at
# SHAPES against jla (IMPLS: deltajax's implementations, default "pallas";
# e.g. "pallas mosaic mosaic/8"), and one profiled forward+backward (Nsight
# Compute, impl="auto") at the first shape. Everything lands in $OUT as it
# goes (gpu_tests.log, bench.log, results.md, step.csv): under a timeout,
# run it unpiped, or what a pipe held is lost with it.
set -uo pipefail
gate=$1; tests=$2; shapes=$3; impls=${4:-pallas}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -n "$tests" ]; then
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu.py \
    -k "$tests" 2>&1 | tee "$out/gpu_tests.log" | grep -v "^$"
fi
python3 benchmarks/benchmark.py --gate "$gate" --impls $impls --peers jla \
  --reps 10 --shapes $shapes --out "$out" 2>&1 | tee "$out/bench.log" \
  | tail -n 30
ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  --log-file "$out/step.csv" python3 benchmarks/ncu_step.py --gate "$gate" \
  --impl auto --shape "${shapes%% *}" > /dev/null 2>&1
tail -c 20 "$out/step.csv" > /dev/null && echo "profile: $out/step.csv"
