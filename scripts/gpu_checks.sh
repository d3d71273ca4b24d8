#!/usr/bin/env bash
# Every measurement that needs a GPU, in one command: versions, the FBGEMM CUDA
# kernels, the CUDA test tier, the whole suite, bench_gpu (quick, then full)
# and the example on one GPU. Each step's log and JSON land in OUT_DIR; a step
# that fails is reported and the next one runs.
#
# On a GPU machine, from the repository root:
#   bash scripts/gpu_checks.sh [OUT_DIR]          # default: $OUT, else bench_out/gpu_checks
# Steps to run (default all): GPU_CHECKS="env kernels cuda_tier bench_quick bench bench_large llm suite example"
# The suite step: SUITE_MARK (marker expression, e.g. "not cuda" when cuda_tier runs beside it),
# SUITE_WORKERS (pytest-xdist workers), SUITE_TEST_TIMEOUT (seconds per test, with pytest-timeout).
#
# A GPU machine with torch but no package index (the image this project's
# device runs use): prepare the bundle here first, then copy .gpu/ along:
#   bash scripts/gpu_checks.sh --prepare         # .gpu/site.tar.xz + .gpu/extra/*.whl + .gpu/plugins/*.whl
# The run unpacks .gpu/site.tar.xz (TorchRec + slim FBGEMM-GPU, built by
# ../shared/tools/gpu_bundle.sh) and the pure-Python wheels in .gpu/extra
# (pytest and its dependencies) and .gpu/plugins (pytest-xdist, execnet,
# pytest-timeout) into /tmp/site, first on PYTHONPATH. scripts/gpu_run.sh is
# the one bounded device call built on this script (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude; }
  [ -f .gpu/site.tar.xz ] || bash ../shared/tools/gpu_bundle.sh
  mkdir -p .gpu/extra
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/extra \
    pytest pluggy iniconfig packaging pygments
  mkdir -p .gpu/plugins
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/plugins \
    pytest-xdist execnet pytest-timeout
  ls -la .gpu .gpu/extra .gpu/plugins
  exit 0
fi

out=${1:-${OUT:-bench_out/gpu_checks}}
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -f .gpu/site.tar.xz ]; then
  # Unpacked once per machine, so that several invocations (steps run side by
  # side) never extract over each other's imports.
  if [ ! -f /tmp/site/.balancer_unpacked ]; then
    mkdir -p /tmp/site
    tar xJf .gpu/site.tar.xz -C /tmp/site || { echo "unpacking .gpu/site.tar.xz failed: rebuild it with --prepare"; exit 1; }
    # pytest's wheels only where the image has no pytest: a newer pytest
    # first on the path would meet the image's own plugins. Each plugin only
    # where the image lacks it.
    if ! "$py" -c "import pytest" 2>/dev/null; then
      for whl in .gpu/extra/*.whl; do
        [ -f "$whl" ] && "$py" -m zipfile -e "$whl" /tmp/site
      done
    fi
    for plugin in xdist:pytest_xdist execnet:execnet pytest_timeout:pytest_timeout; do
      "$py" -c "import ${plugin%%:*}" 2>/dev/null && continue
      for whl in .gpu/plugins/"${plugin##*:}"-*.whl; do
        [ -f "$whl" ] && "$py" -m zipfile -e "$whl" /tmp/site
      done
    done
    touch /tmp/site/.balancer_unpacked
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
all_steps="env kernels cuda_tier bench_quick bench bench_large llm suite example"
steps=${GPU_CHECKS:-$all_steps}
for s in $steps; do
  case " $all_steps " in *" $s "*) ;; *) echo "GPU_CHECKS: unknown step '$s', expected some of: $all_steps"; exit 2 ;; esac
done
failed=()

run_step() {  # name, command...: log to $out/name.log, print the verdict and the tail
  local name=$1 t0 rc
  shift
  echo "== $name: $*"
  t0=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s (log: $out/$name.log)"
  tail -n 15 "$out/$name.log"
  [ "$rc" -eq 0 ] || failed+=("$name")
  return "$rc"
}

want() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if want env; then
  run_step env "$py" -c "
import sys, torch
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False: no GPU, or a CPU build of torch'
print('device', torch.cuda.get_device_name(), 'count', torch.cuda.device_count())
import numpy, fbgemm_gpu, torchrec
print('numpy', numpy.__version__, 'torchrec', torchrec.__version__)
" || { echo "no usable GPU environment: stopping"; exit 1; }
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
fi
if want kernels; then
  # fbgemm's CUDA kernels (the CPU wheel on a GPU machine fails here, not in the tests).
  run_step kernels "$py" -c "
import torch, fbgemm_gpu
d = 'cuda'
_, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(torch.tensor([1, 0], dtype=torch.int32, device=d),
                                                   torch.tensor([1, 2], dtype=torch.int32, device=d),
                                                   torch.arange(3, device=d))
assert out.tolist() == [1, 2, 0], out
print('permute_1D_sparse_data on', out.device, out.tolist())
"
fi
# A stalled test fails with every thread's stack (pytest-timeout) instead of
# eating the device time.
timeout_opt() { "$py" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$1"; }
if want cuda_tier; then
  # shellcheck disable=SC2046
  run_step cuda_tier "$py" -m pytest -m cuda -rs -q -p no:cacheprovider --junitxml="$out/cuda_tier.xml" \
    $(timeout_opt "${CUDA_TIER_TEST_TIMEOUT:-150}")
fi
if want bench_quick; then
  run_step bench_quick "$py" benchmarks/bench_gpu.py --quick --device cuda --json-out "$out/gpu_quick.jsonl"
fi
if want bench; then
  plot=()
  "$py" -c "import matplotlib" 2>/dev/null && plot=(--plot "$out/gpu_speedup.png")
  run_step bench "$py" benchmarks/bench_gpu.py --device cuda --json-out "$out/gpu.jsonl" "${plot[@]}"
fi
if want bench_large; then
  # Compute-bound ranks (the default model is launch-bound on an H100/H200), each
  # rank timed 3 times per step: the timing spread, and the noise floor (every
  # rank on the same samples), bound what noise adds to the residual straggler.
  run_step bench_large "$py" benchmarks/bench_gpu.py --device cuda --hidden 1024 --heads 8 --layers 4 \
    --max-len 8192 --world-sizes 8 16 --batch-sizes 32 --steps 12 --repeats 3 --noise-floor --no-shuffle \
    --json-out "$out/gpu_large.jsonl"
fi
if want llm; then
  # LLM-style DP with gradient accumulation: verl's split and micro-batches against plan_dispatch.
  run_step llm "$py" benchmarks/bench_gpu_llm.py --device cuda --json-out "$out/gpu_llm.jsonl"
fi
if want suite; then
  extra=()
  # SUITE_WORKERS=N runs N in parallel (pytest-xdist).
  t=$(timeout_opt "${SUITE_TEST_TIMEOUT:-240}") && extra+=("$t")
  if [ -n "${SUITE_WORKERS:-}" ]; then
    if "$py" -c "import xdist" 2>/dev/null; then
      extra+=(-n "$SUITE_WORKERS")
    else
      echo "SUITE_WORKERS=$SUITE_WORKERS but pytest-xdist is missing: the suite runs in one process (long)"
    fi
  fi
  # -v: one line per finished test, so that the names survive a run killed
  # before pytest's summary (the junit XML is written only at the end).
  run_step suite "$py" -m pytest -v -rs -p no:cacheprovider --junitxml="$out/suite.xml" --durations=15 \
    ${SUITE_MARK:+-m "$SUITE_MARK"} "${extra[@]}"
fi
if want example; then
  # The bundle has no TBE kernels, which TorchRec's fused and dense embedding
  # kernels both call (dense: fbgemm.dense_embedding_codegen_lookup_function,
  # seen missing on an H200): there, plain torch embeddings and the BalancedLoader.
  mode=(--enable-balanced-shuffler --embedding-kernel fused)
  [ -f .gpu/site.tar.xz ] && mode=(--balanced-loader --embedding-kernel torch)
  run_step example "$py" -m torch.distributed.run --nproc_per_node=1 examples/train_hstu.py "${mode[@]}"
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed steps: ${failed[*]}"
  exit 1
fi
echo "all steps passed: $steps"
