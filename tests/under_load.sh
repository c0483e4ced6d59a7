#!/bin/bash
# Run the whole suite RUNS times in a row (default 5) beside LOAD CPU-bound processes (default
# 2), stopping at the first failure: the flake check of a loaded machine. Logs go to
# $LOGS/run<i>.log (default /tmp/under_load). Usage: bash tests/under_load.sh [RUNS] [LOAD]
cd "$(dirname "$0")/.."
RUNS=${1:-5} LOAD=${2:-2} LOGS=${LOGS:-/tmp/under_load} PY=${PY:-.venv/bin/python}
mkdir -p "$LOGS"
burners=()
for _ in $(seq "$LOAD"); do
  python3 -c "while True: pass" & burners+=($!)
done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT
for i in $(seq "$RUNS"); do
  start=$(date +%s)
  if PYTHONPATH="$PWD" $PY -m pytest -q -n auto --dist worksteal -p no:cacheprovider > "$LOGS/run$i.log" 2>&1; then
    echo "run $i of $RUNS passed under load $LOAD in $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/run$i.log")"
  else
    echo "run $i of $RUNS FAILED under load $LOAD (log: $LOGS/run$i.log):"
    grep -E "^(FAILED|ERROR)" "$LOGS/run$i.log"
    exit 1
  fi
done
