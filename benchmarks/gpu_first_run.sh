#!/usr/bin/env bash
# The first run of poslsh on a GPU: correctness, then the 128k and 32k timings, then the GPU
# tests, in at most 330 s of stage limits (6 minutes of a 15-minute device lease, with start-up).
#
#   bash benchmarks/gpu_first_run.sh                 # from the repository root, on a CUDA machine
#   bash benchmarks/gpu_first_run.sh --dry-run       # the same code path on the CPU (~1 min)
#   bash benchmarks/gpu_first_run.sh --check-budget  # print the budget arithmetic
#
# Needs torch (with FlexAttention) + triton on the machine; installs nothing. Every stage runs
# under `timeout` with its own limit (seconds) and writes each result the moment it is measured,
# as a row of $OUT/results.md and results.csv (--out DIR, else $OUT, else outputs/gpu_first_run/):
#   warm    75  compile every kernel of stages check..t32k in 6 parallel processes (disk caches)
#   check   58  bf16 n=4096 fwd+bwd vs the float64 oracle: triton, flex (with lse), the window op
#   t128k   60  n=131072 timings, fwd and fwd+bwd, and the targets
#   t32k    40  n=32768, the same
#   tests   87  pytest -m gpu in parallel shards, one row per test with its printed errors
# 320 s of limits + 5 x 2 s of kill grace = 330 s. A stage that fails or times out is reported
# and the next one still runs; the exit status is 1 if any did.
#
# Options: --dry-run, --out DIR, --stages a,b, --limits name=s,..., --check-budget (gpu_stages.sh).
cd "$(dirname "$0")/.." || exit 2
STAGES=(warm:75 check:58 t128k:60 t32k:40 tests:87)
TITLE="poslsh first GPU run"
HEADER_LINES=(
  "Configuration: bf16, B = 1, H = 16 ALiBi heads, d = 128, s = 10 i.i.d. samples, causal; autotuning off"
  "(POSLSH_TRITON_AUTOTUNE=0, FlexAttention's default kernels); times: median of CUDA-event repetitions,"
  "fwd = the forward of a training step (inputs require grad), fwd+bwd = forward + backward."
  ""
  "**Targets** (n = 131072, bf16, H = 16, d = 128, s = 10, causal, fwd+bwd): poslsh-triton >= 60x faster"
  "than exact ALiBi (exact-flex) and <= 0.8x the time of the 10-sigma window on FlexAttention (window-flex);"
  "the Triton window (window-triton) >= 100x faster than exact ALiBi and faster than window-flex."
  ""
  "Methods: poslsh-triton / poslsh-flex = positional LSH on the fused kernel / on FlexAttention;"
  "window-flex / window-triton = windowed_alibi_attention (window ceil(10 sigma_h) per head);"
  "exact-flex = exact ALiBi (the window op with window = n); sdpa-flash = dense flash attention, no bias."
)

run_stage() {   # run_stage NAME LIMIT
  local py=${PYTHON:-python3} dry=()
  [ $DRY_RUN -eq 1 ] && dry=(--dry-run)
  local common=(--out "$DEST" --stage "$1" "${dry[@]}")
  case $1 in
    warm)  stage "$1" "$2" "$py" benchmarks/gpu_first_run.py warm "${common[@]}" ;;
    check) stage "$1" "$2" "$py" benchmarks/gpu_first_run.py check "${common[@]}" ;;
    t128k) stage "$1" "$2" "$py" benchmarks/gpu_first_run.py times --n 131072 "${common[@]}" ;;
    t32k)  stage "$1" "$2" "$py" benchmarks/gpu_first_run.py times --n 32768 "${common[@]}" ;;
    tests) stage "$1" "$2" "$py" benchmarks/gpu_first_run.py tests "${common[@]}" ;;
  esac
}

source benchmarks/gpu_stages.sh
run_all "$@"
