#!/usr/bin/env bash
# The first run of poslsh's Triton kernels on a GPU: correctness, then speed, in under 8 minutes.
#
#   bash benchmarks/gpu_first_run.sh            # from the repository root, on a CUDA machine
#
# Needs torch + triton (>= 3.4) on the machine; nothing is installed (runs as PYTHONPATH=. python3).
# Stages, each with its own time limit (seconds); a stage that fails or times out is reported and
# the next one still runs:
#   0  env          10   GPU, torch, triton, numpy versions
#   1  warm         70   compile the kernel variants of stages 2-4 in parallel processes (Triton's cache)
#   2  tests       130   POSLSH_TRITON_AUTOTUNE=0 python3 -m pytest -q -m gpu tests/ops/test_triton.py tests/ops/test_low_precision.py
#   3  check        60   bf16 n=4096 fwd+bwd vs the float64 oracle, TMA vs pointers, 2 vs 1 launches,
#                        bitwise determinism (benchmarks/bench_gpu.py --check)
#   4  timings     200   n = 131072 and 32768, bf16, 16 ALiBi heads, d = 128, s = 10, causal, fwd and
#                        fwd+bwd: poslsh triton vs FlexAttention 10-sigma window, SDPA flash (no bias),
#                        FlexAttention exact ALiBi (score_mod); one markdown table (autotuning off)
#   5  grouped      60   the same kernel at n = 131072, s = 20, grouped partitions (lattice counts)
#   6  iid20        60   ... and i.i.d. partitions at s = 20: the two tables side by side
# Total limit 590 s. Logs and results go to $OUT when it is set (else outputs/gpu_first_run/).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}:${PWD}/paper${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-outputs/gpu_first_run}
mkdir -p "$DEST"
SUMMARY="$DEST/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

stage() {   # stage NAME LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== stage $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
  timeout --kill-after=5 "$limit" "$@" > >(tee "$DEST/$name.log") 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (rc=$rc)"
  echo "=== stage $name: $verdict in $(( $(date +%s) - t0 ))s" | tee -a "$SUMMARY"
}

stage env 10 $PY -c "
import torch, triton, numpy
print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)
from poslsh.ops.triton import _config
print('triton problem:', _config.version_problem(), '| interpreter problem:', _config.interpreter_problem())"
stage warm 70 $PY benchmarks/bench_gpu.py --warm
stage tests 130 env POSLSH_TRITON_AUTOTUNE=0 $PY -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton.py tests/ops/test_low_precision.py
stage check 60 env POSLSH_TRITON_AUTOTUNE=0 $PY benchmarks/bench_gpu.py --check
stage timings 200 env POSLSH_TRITON_AUTOTUNE=0 $PY benchmarks/bench_gpu.py --n 131072 32768 \
  --methods poslsh-triton alibi-window sdpa-dense alibi-flex --rep-ms 25 \
  --csv "$DEST/bench_gpu.csv" --png /tmp/poslsh_bench_gpu.png --md "$DEST/bench_gpu.md"
stage grouped 60 env POSLSH_TRITON_AUTOTUNE=0 $PY benchmarks/bench_gpu.py --n 131072 --methods poslsh-triton \
  --samples 20 --sampler grouped --rep-ms 25 --csv "$DEST/bench_gpu_grouped.csv" --png /tmp/poslsh_bench_gpu_g.png \
  --md "$DEST/bench_gpu_grouped.md"
stage iid20 60 env POSLSH_TRITON_AUTOTUNE=0 $PY benchmarks/bench_gpu.py --n 131072 --methods poslsh-triton \
  --samples 20 --rep-ms 25 --csv "$DEST/bench_gpu_iid20.csv" --png /tmp/poslsh_bench_gpu_i.png \
  --md "$DEST/bench_gpu_iid20.md"

echo "=== total $(( $(date +%s) - START ))s; table: $DEST/bench_gpu.md" | tee -a "$SUMMARY"
cat "$SUMMARY"
for f in bench_gpu bench_gpu_iid20 bench_gpu_grouped; do [ -f "$DEST/$f.md" ] && cat "$DEST/$f.md"; done
exit 0
