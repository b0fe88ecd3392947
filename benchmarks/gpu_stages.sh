# Shared by gpu_first_run.sh and gpu_more.sh (sourced, not run): options, the interpreter, the carried
# wheels, the budget check, the stage runner and the summary. The sourcing script defines STAGES
# ("name:limit ..."), TITLE, HEADER_LINES (an array) and a function run_stage NAME LIMIT that runs one stage.
#
# Options: --dry-run (CPU: Triton interpreter, float32, tiny sizes), --out DIR (default $OUT,
# else outputs/<script name>), --stages a,b (run only these), --limits name=s,... (change limits),
# --check-budget (print the arithmetic and exit), --check-env (print the interpreter and versions
# the stages would run with, and exit). Exit status: 0 all stages ok, 1 a stage failed or timed
# out, 2 bad options, a budget over BUDGET_S, or an interpreter without torch.
#
# The interpreter: $PYTHON when set; else the project's .venv/bin/python when it exists (what `make
# setup` / `make demo` create); else python3 (the GPU machine: its own python3, no .venv).
# The carried wheels: when .gpu/*.whl exist (`make gpu-bundle`: transformers of the tested range and
# what the machine's packages cannot serve it), they are unpacked once into $TMPDIR and put first on
# PYTHONPATH, so the stages import them before the installed ones.
set -u
BUDGET_S=${BUDGET_S:-540}     # device seconds the stage limits may take in all, grace periods included
GRACE_S=2                     # SIGTERM, then SIGKILL this much later (counted in the budget)
DRY_RUN=0
ONLY=""
CHECK_ONLY=0
CHECK_ENV=0
DEST=${OUT:-}

parse_options() {
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --out) DEST=$2; shift ;;
      --stages) ONLY=",$2," ; shift ;;
      --limits) local kv; for kv in ${2//,/ }; do set_limit "${kv%%=*}" "${kv#*=}" || return 2; done; shift ;;
      --check-budget) CHECK_ONLY=1 ;;
      --check-env) CHECK_ENV=1 ;;
      -h|--help) sed -n '2,/^cd /p' "$0" | grep -v '^cd ' | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "unknown option $1 (see --help)" >&2; return 2 ;;
    esac
    shift
  done
}

find_python() {   # sets PY: $PYTHON, else the project's .venv, else python3
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
  elif [ -x "$PWD/.venv/bin/python" ]; then PY=$PWD/.venv/bin/python
  else PY=python3
  fi
}

use_bundle() {   # .gpu/*.whl unpacked into $TMPDIR/poslsh-gpu-bundle, first on PYTHONPATH (POSLSH_GPU_BUNDLE)
  local whl site=${TMPDIR:-/tmp}/poslsh-gpu-bundle
  compgen -G ".gpu/*.whl" > /dev/null || return 0
  rm -rf "$site" && mkdir -p "$site" || return 1
  for whl in .gpu/*.whl; do
    "$PY" -m zipfile -e "$whl" "$site" || { echo "could not unpack $whl into $site" >&2; return 1; }
  done
  export POSLSH_GPU_BUNDLE=$site PYTHONPATH="$site:$PYTHONPATH"
  echo "bundle: $(cd .gpu && ls *.whl | tr '\n' ' ')first on PYTHONPATH (unpacked in $site)"
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

rows_py() {   # gpu_rows.py needs no package: the stages' interpreter, else any python3
  "$PY" benchmarks/gpu_rows.py "$@" 2> /dev/null || python3 benchmarks/gpu_rows.py "$@"
}

row() {   # row STAGE ITEM RESULT [VALUE [UNIT [DETAIL]]]
  rows_py row "$DEST" "$@" > /dev/null
}

FAILED=""
stage() {   # stage NAME LIMIT COMMAND...: under `timeout`, logged to DEST/logs/NAME.log; one row and one line
  local name=$1 limit=$2; shift 2
  local t0 rc verdict secs said
  t0=$(date +%s%N)
  timeout --kill-after="$GRACE_S" "$limit" "$@" > "$DEST/logs/$name.log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  case $rc in
    0) verdict=ok ;;
    124|137) verdict="timed out" ;;
    *) verdict="failed" ;;
  esac
  [ "$verdict" = ok ] || FAILED="$FAILED $name"
  said=$(rows_py summary "$DEST" "$name" "$DEST/logs/$name.log" "$rc" | tail -1)
  row "$name" "stage $name" "$verdict" "$secs" s "limit ${limit} s, exit status $rc; $said; log logs/$name.log"
  echo "stage $name: $verdict in ${secs} s (limit ${limit} s): $said"
}

reserved() {   # reserved NAME WHAT: a stage whose code is not in the tree yet keeps its place and its budget
  row "$1" "stage $1" "skipped" "" "" "reserved: $2"
  echo "stage $1: skipped (reserved: $2)"
}

run_all() {   # run_all "$@": options, interpreter, budget, headers, every selected stage, summary, exit status
  parse_options "$@" || exit 2
  [ -n "$DEST" ] || DEST="outputs/$(basename "$0" .sh)"
  [ $DRY_RUN -eq 1 ] && TITLE="$TITLE (DRY RUN on the CPU: no number here is a GPU number)"
  find_python
  export PYTHONPATH="${PWD}:${PWD}/paper${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export POSLSH_TRITON_AUTOTUNE=0 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1 \
         TORCHINDUCTOR_AUTOGRAD_CACHE=1
  if [ $DRY_RUN -eq 1 ]; then export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""; fi
  echo "interpreter: $PY"
  if [ $CHECK_ENV -eq 1 ]; then
    use_bundle || exit 2
    "$PY" benchmarks/gpu_env.py $([ $DRY_RUN -eq 1 ] && echo --dry-run); exit $?
  fi
  check_budget || exit 2
  [ $CHECK_ONLY -eq 1 ] && exit 0
  mkdir -p "$DEST/logs" || exit 2
  rows_py header "$DEST" "$TITLE" "${HEADER_LINES[@]}" || exit 2
  use_bundle || { row env bundle error "" "" "the wheels in .gpu/ could not be unpacked"; exit 2; }
  # an interpreter without torch stops here in one line (every stage would fail the same way)
  local rc
  "$PY" benchmarks/gpu_env.py --out "$DEST" $([ $DRY_RUN -eq 1 ] && echo --dry-run); rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 2 ] || echo "stopping: $PY could not run benchmarks/gpu_env.py (exit status $rc); set PYTHON" >&2
    exit 2
  fi
  local s start
  start=$(date +%s)
  for s in "${STAGES[@]}"; do
    selected "${s%%:*}" && run_stage "${s%%:*}" "${s#*:}"
  done
  echo
  echo "=== $(basename "$0")$([ $DRY_RUN -eq 1 ] && echo ' --dry-run'): $(( $(date +%s) - start )) s;" \
       "results in $DEST/results.md and results.csv, logs in $DEST/logs.tar.gz"
  tar czf "$DEST/logs.tar.gz" -C "$DEST" logs
  # on the GPU machine only what is under $OUT comes back, eight files at most: the logs travel packed
  if [ -n "${OUT:-}" ] && [ "$DEST" = "${OUT:-}" ]; then rm -rf "$DEST/logs"; fi
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
