#!/usr/bin/env bash
# Runs every end-to-end test on PostgreSQL N times in a row (default 10), stopping at the first
# failing run; one log per run in $DRIFTSAFE_REPEAT_LOGS (default /tmp/driftsafe-e2e-repeat).
# Needs the test command's virtual environment (bash tests/run.sh builds it) and its services.
# The chaos test is included only with --chaos: it restarts PostgreSQL (and a Redis of its own).
#   bash tests/repeat_e2e.sh [N] [--chaos]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
filter=(-k "not chaos")
[ "${2:-}" = "--chaos" ] && filter=()
logs=${DRIFTSAFE_REPEAT_LOGS:-/tmp/driftsafe-e2e-repeat}
mkdir -p "$logs"
PY=${DRIFTSAFE_VENV:-.venv-test}/bin/python
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  DRIFTSAFE_TEST_DB=postgres "$PY" -m pytest -q -p no:cacheprovider -m e2e "${filter[@]}" tests \
    > "$logs/run-$i.log" 2>&1
  code=$?
  echo "run $i of $runs: exit $code in $(( $(date +%s) - start )) s: $(tail -1 "$logs/run-$i.log")"
  [ "$code" = 0 ] || { echo "run $i failed; see $logs/run-$i.log"; exit 1; }
done
echo "all $runs runs passed"
