#!/usr/bin/env bash
# The GPU checks as one bounded device call (a lease of ~15 minutes, at most 8
# files back): scripts/gpu_checks.sh's GPU steps first, then the suite in the
# time left, everything packed into OUT_DIR/gpu_checks.tgz with the main logs
# beside it.
#
#   bash scripts/gpu_checks.sh --prepare     # here, once: builds .gpu/ (carry it along)
#   bash scripts/gpu_run.sh [OUT_DIR]        # on the GPU machine; default $OUT
#
# GPU_RUN_BUDGET (540 s): the whole call, within the device tool's timeout_s
# (pass ~580). GPU_RUN_STEPS ("env kernels cuda_tier bench llm example") get at
# most GPU_RUN_STEPS_S (260 s); the suite (without the CUDA tier, which ran
# among the steps) gets what is left, and runs only if the env step passed.
# bench_quick and bench_large are left out: bench covers bench_quick's CUDA
# paths, and bench_large takes ~100 s (run them by GPU_RUN_STEPS).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:?give OUT_DIR or set OUT}}
budget=${GPU_RUN_BUDGET:-540}
export PYTHONUNBUFFERED=1
SECONDS=0
logs=$(mktemp -d /tmp/gpu_checks.XXXX)
mkdir -p "$out"

GPU_CHECKS=${GPU_RUN_STEPS:-env kernels cuda_tier bench llm example} \
  timeout -k 10 "${GPU_RUN_STEPS_S:-260}" bash scripts/gpu_checks.sh "$logs"
steps_rc=$?
suite_rc=0
echo "== gpu steps: exit $steps_rc at ${SECONDS} s"

left=$((budget - SECONDS))
if ! grep -q '^numpy ' "$logs/env.log" 2>/dev/null; then
  echo "== the env step failed (see env.log): suite skipped"
elif [ "$left" -lt 60 ]; then
  echo "== ${left} s left of ${budget}: suite skipped"
else
  GPU_CHECKS=suite SUITE_WORKERS=${SUITE_WORKERS:-10} SUITE_MARK=${SUITE_MARK:-not cuda} \
    SUITE_TEST_TIMEOUT=${SUITE_TEST_TIMEOUT:-150} \
    timeout -k 10 "$((left - 15))" bash scripts/gpu_checks.sh "$logs"
  suite_rc=$?
  echo "== suite: exit $suite_rc at ${SECONDS} s"
  grep -E '^(FAILED|ERROR)|passed|failed' "$logs/suite.log" | tail -n 25
fi

tar czf "$out/gpu_checks.tgz" -C "$logs" .
for f in env cuda_tier bench llm example; do
  [ -f "$logs/$f.log" ] && cp "$logs/$f.log" "$out/"
done
ls -la "$logs"
echo "== done in ${SECONDS} s: $out/gpu_checks.tgz (every log and JSON) and the main logs"
# A failed (or timed-out) step or suite fails the call; a skipped suite does not by itself.
[ "$steps_rc" -eq 0 ] && [ "$suite_rc" -eq 0 ]
