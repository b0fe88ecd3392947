#!/usr/bin/env bash
# The first run of poslsh on a GPU, one command for one device lease: correctness against the float64
# oracle, the 128k and 32k timings, patched transformers models, the per-head cache's decoding, long-context
# decoding, then the GPU tests, in at most 540 s of stage limits (9 minutes; docs/gpu.md has the device call).
#
#   bash benchmarks/gpu_first_run.sh                 # from the repository root, on a CUDA machine
#   bash benchmarks/gpu_first_run.sh --dry-run       # the same code path on the CPU (~1 min)
#   bash benchmarks/gpu_first_run.sh --check-budget  # print the budget arithmetic
#   bash benchmarks/gpu_first_run.sh --check-env     # the interpreter and versions the stages would use
#
# Needs torch (with FlexAttention) + triton on the machine; installs nothing. The interpreter: $PYTHON,
# else .venv/bin/python when it exists (after `make demo`), else python3. Carried wheels in .gpu/
# (`make gpu-bundle`: transformers of the tested range) go first on PYTHONPATH. Every stage runs under
# `timeout` with its own limit (seconds), prints one line (its verdict, its rows counted, the first
# failure and why rows were unavailable; the log in logs/) and writes each result the moment it is
# measured, as a row of $OUT/results.md and results.csv (--out DIR, else $OUT, else outputs/gpu_first_run/):
#   warm     75  compile every kernel of stages check..t32k in 6 parallel processes (disk caches)
#   check    58  bf16 n=4096 fwd+bwd vs the float64 oracle: triton, flex (with lse), the window op
#   t128k    60  n=131072 timings, fwd and fwd+bwd, and the targets
#   t32k     40  n=32768, the same
#   models   70  patch_alibi on a BLOOM-560m-shaped model, bf16: exact and certified vs float64, peak memory vs eager
#   cache    40  the per-head window cache: decoding step by step vs the float64 forward, generate()
#   encoders 35  ALiBi encoders (DNABERT-2 shapes), bf16: exact and certified vs float64, time and memory vs dense
#   decode   45  patched BLOOM-560m-shaped decoding, bf16: exact (AppendCache) and certified vs float64, ms/token
#   tests    87  pytest -m gpu in parallel shards, one row per test with its printed errors
# 510 s of limits + 9 x 2 s of kill grace = 528 s. A stage that fails or times out is reported in one
# line and the next one still runs; the exit status is 1 if any did.
#
# Options: --dry-run, --out DIR, --stages a,b, --limits name=s,..., --check-budget, --check-env (gpu_stages.sh).
cd "$(dirname "$0")/.." || exit 2
# The stage list, in running order (name:limit in seconds). A new stage gets a line here, a case in
# run_stage below and its limit inside the budget (tests/test_gpu_first_run.py checks all three).
STAGES=(warm:75 check:58 t128k:60 t32k:40 models:70 cache:40 encoders:35 decode:45 tests:87)
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
  "models / cache: transformers' BloomModel / BloomForCausalLM at BLOOM-560m's shapes (random weights,"
  "vocabulary 4096), eager against patch_alibi; errors against the same model in float64."
)

run_stage() {   # run_stage NAME LIMIT
  local dry=()
  [ $DRY_RUN -eq 1 ] && dry=(--dry-run)
  local common=(--out "$DEST" --stage "$1" "${dry[@]}")
  case $1 in
    warm)     stage "$1" "$2" "$PY" benchmarks/gpu_first_run.py warm "${common[@]}" ;;
    check)    stage "$1" "$2" "$PY" benchmarks/gpu_first_run.py check "${common[@]}" ;;
    t128k)    stage "$1" "$2" "$PY" benchmarks/gpu_first_run.py times --n 131072 "${common[@]}" ;;
    t32k)     stage "$1" "$2" "$PY" benchmarks/gpu_first_run.py times --n 32768 "${common[@]}" ;;
    models)   stage "$1" "$2" "$PY" benchmarks/gpu_models.py models "${common[@]}" ;;
    cache)    stage "$1" "$2" "$PY" benchmarks/gpu_models.py cache "${common[@]}" ;;
    encoders) stage "$1" "$2" "$PY" benchmarks/gpu_encoders.py "${common[@]}" ;;
    decode)   stage "$1" "$2" "$PY" benchmarks/gpu_decode.py "${common[@]}" ;;
    tests)    stage "$1" "$2" "$PY" benchmarks/gpu_first_run.py tests "${common[@]}" ;;
    *)        echo "stage $1: no such stage in run_stage" >&2; FAILED="$FAILED $1" ;;
  esac
}

source benchmarks/gpu_stages.sh
run_all "$@"
