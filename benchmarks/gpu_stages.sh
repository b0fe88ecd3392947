# Shared by gpu_first_run.sh and gpu_more.sh (sourced, not run): options, the budget check,
# the stage runner and the summary. The sourcing script defines STAGES ("name:limit ..."),
# TITLE, HEADER_LINES (an array) and a function run_stage NAME LIMIT that runs one stage.
#
# Options: --dry-run (CPU: Triton interpreter, float32, tiny sizes), --out DIR (default $OUT,
# else outputs/<script name>), --stages a,b (run only these), --limits name=s,... (change limits),
# --check-budget (print the arithmetic and exit). Exit status: 0 all stages ok, 1 a stage failed
# or timed out, 2 bad options or a budget over BUDGET_S.
set -u
BUDGET_S=${BUDGET_S:-330}     # device seconds the stage limits may take in all, grace periods included
GRACE_S=2                     # SIGTERM, then SIGKILL this much later (counted in the budget)
DRY_RUN=0
ONLY=""
CHECK_ONLY=0
DEST=${OUT:-}

parse_options() {
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --out) DEST=$2; shift ;;
      --stages) ONLY=",$2," ; shift ;;
      --limits) local kv; for kv in ${2//,/ }; do set_limit "${kv%%=*}" "${kv#*=}" || return 2; done; shift ;;
      --check-budget) CHECK_ONLY=1 ;;
      -h|--help) sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//' | grep -v '^set -u'; exit 0 ;;
      *) echo "unknown option $1 (see --help)" >&2; return 2 ;;
    esac
    shift
  done
}

set_limit() {   # set_limit NAME SECONDS
  local i found=0
  case $2 in ''|*[!0-9]*) echo "--limits: $1=$2 is not a whole number of seconds" >&2; return 2 ;; esac
  for i in "${!STAGES[@]}"; do
    if [ "${STAGES[$i]%%:*}" = "$1" ]; then STAGES[$i]="$1:$2"; found=1; fi
  done
  [ $found -eq 1 ] || { echo "--limits: no stage named $1 (stages: ${STAGES[*]%%:*})" >&2; return 2; }
}

selected() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }

check_budget() {   # the worst case: every selected stage runs to its limit plus the kill grace
  local s total=0 parts=""
  for s in "${STAGES[@]}"; do
    selected "${s%%:*}" || continue
    total=$(( total + ${s#*:} + GRACE_S ))
    parts="$parts + ${s#*:}+${GRACE_S} (${s%%:*})"
  done
  echo "budget: ${parts# + } = ${total} s of at most ${BUDGET_S} s"
  if [ $total -gt "$BUDGET_S" ]; then
    echo "refusing to start: the stage limits add up to ${total} s > ${BUDGET_S} s" >&2
    return 2
  fi
}

row() {   # row STAGE ITEM RESULT [VALUE [UNIT [DETAIL]]]  (gpu_rows.py needs no package: any python3)
  python3 benchmarks/gpu_rows.py row "$DEST" "$@" > /dev/null
}

FAILED=""
stage() {   # stage NAME LIMIT COMMAND...: run under `timeout`, log to DEST/NAME.log, one row with the verdict
  local name=$1 limit=$2; shift 2
  local t0 rc verdict secs
  t0=$(date +%s%N)
  echo "=== stage $name (limit ${limit} s): $*"
  timeout --kill-after="$GRACE_S" "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
  rc=${PIPESTATUS[0]}
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  case $rc in
    0) verdict=ok ;;
    124|137) verdict="timed out" ;;
    *) verdict="failed" ;;
  esac
  [ "$verdict" = ok ] || FAILED="$FAILED $name"
  row "$name" "stage $name" "$verdict" "$secs" s "limit ${limit} s, exit status $rc; log $name.log"
  echo "=== stage $name: $verdict (exit status $rc) in ${secs} s"
}

run_all() {   # run_all "$@": options, budget, headers, every selected stage, summary, exit status
  parse_options "$@" || exit 2
  [ -n "$DEST" ] || DEST="outputs/$(basename "$0" .sh)"
  [ $DRY_RUN -eq 1 ] && TITLE="$TITLE (DRY RUN on the CPU: no number here is a GPU number)"
  check_budget || exit 2
  [ $CHECK_ONLY -eq 1 ] && exit 0
  mkdir -p "$DEST" || exit 2
  export PYTHONPATH="${PWD}:${PWD}/paper${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export POSLSH_TRITON_AUTOTUNE=0 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1 \
         TORCHINDUCTOR_AUTOGRAD_CACHE=1
  if [ $DRY_RUN -eq 1 ]; then export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""; fi
  python3 benchmarks/gpu_rows.py header "$DEST" "$TITLE" "${HEADER_LINES[@]}" || exit 2
  local s start
  start=$(date +%s)
  for s in "${STAGES[@]}"; do
    selected "${s%%:*}" && run_stage "${s%%:*}" "${s#*:}"
  done
  echo
  echo "=== $(basename "$0")$([ $DRY_RUN -eq 1 ] && echo ' --dry-run'): $(( $(date +%s) - start )) s;" \
       "results in $DEST/results.md and results.csv"
  # the rows that matter first: stages, checks, timings, targets, failed tests (every test is in the file)
  grep -v '^| tests | tests/' "$DEST/results.md"
  if grep -q '^| tests | tests/' "$DEST/results.md"; then
    grep '^| tests | tests/.* | failed |' "$DEST/results.md"
    echo "tests: $(grep -c '^| tests | tests/.* | passed |' "$DEST/results.md") passed," \
         "$(grep -c '^| tests | tests/.* | failed |' "$DEST/results.md") failed," \
         "$(grep -c '^| tests | tests/.* | skipped |' "$DEST/results.md") skipped"
  fi
  if [ -n "$FAILED" ]; then echo "FAILED stages:$FAILED"; exit 1; fi
  exit 0
}
