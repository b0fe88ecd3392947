#!/usr/bin/env bash
# What does not fit the first GPU run (gpu_first_run.sh): longer sweeps, grouped vs i.i.d.
# partitions at s = 20, positional LSH on FlexAttention timed, TMA and launch variants of the
# Triton kernel. A second device lease of its own: at most 540 s of stage limits (322 s used).
#
#   bash benchmarks/gpu_more.sh [--dry-run] [--out DIR] [--stages a,b] [--limits name=s,...]
#
# Stages (limit, seconds), each one `python benchmarks/bench_gpu.py ...` process:
#   grouped20  60  poslsh-triton, s = 20 grouped partitions (lattice counts), n = 131072, 32768
#   iid20      50  the same with s = 20 i.i.d. partitions: the two side by side
#   flex       90  poslsh-flex vs poslsh-triton, n = 32768, 131072 (FlexAttention compiles per n)
#   sweep      40  poslsh-triton and sdpa-flash at n = 4k ... 1M (sdpa up to 256k)
#   tma-off    35  poslsh-triton at 128k with POSLSH_TRITON_TMA=0 (pointer loads)
#   one-launch 35  poslsh-triton at 128k with POSLSH_TRITON_SPLIT=0 (one launch per kernel)
# 310 s + 6 x 2 s of kill grace = 322 s. Rows go to $OUT/results.md and results.csv.
cd "$(dirname "$0")/.." || exit 2
STAGES=(grouped20:60 iid20:50 flex:90 sweep:40 tma-off:35 one-launch:35)
TITLE="poslsh GPU: the sweeps after the first run"
HEADER_LINES=("Configuration unless a stage says otherwise: bf16, B = 1, H = 16 ALiBi heads, d = 128, causal;"
              "autotuning off (POSLSH_TRITON_AUTOTUNE=0); median ms of CUDA-event repetitions.")

run_stage() {   # run_stage NAME LIMIT
  local dry=()
  [ $DRY_RUN -eq 1 ] && dry=(--dry-run)
  local bench=("$PY" benchmarks/bench_gpu.py --out "$DEST" --append --stage "$1" "${dry[@]}")
  case $1 in
    grouped20)  stage "$1" "$2" "${bench[@]}" --n 131072 32768 --methods poslsh-triton --samples 20 --sampler grouped ;;
    iid20)      stage "$1" "$2" "${bench[@]}" --n 131072 32768 --methods poslsh-triton --samples 20 ;;
    flex)       stage "$1" "$2" "${bench[@]}" --n 32768 131072 --methods poslsh-triton poslsh-flex ;;
    sweep)      stage "$1" "$2" "${bench[@]}" --n 4096 16384 65536 262144 524288 1048576 \
                      --methods poslsh-triton sdpa-flash --png "$DEST/sweep.png" ;;
    tma-off)    stage "$1" "$2" env POSLSH_TRITON_TMA=0 "${bench[@]}" --n 131072 --methods poslsh-triton ;;
    one-launch) stage "$1" "$2" env POSLSH_TRITON_SPLIT=0 "${bench[@]}" --n 131072 --methods poslsh-triton ;;
  esac
}

source benchmarks/gpu_stages.sh
run_all "$@"
