#!/usr/bin/env bash
# The main job, on the example project: a fresh virtual environment, a Redis (the one on
# 127.0.0.1:6379, or a redis-server started here on a free port), SQLite, then a beat with
# DriftSafeScheduler and a worker for DEMO_SECONDS (default 20), and what they fired.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(cd .. && pwd)
PYTHON=${PYTHON:-python3}
VENV=${DEMO_VENV:-$ROOT/.venv-demo}
SECONDS_TO_RUN=${DEMO_SECONDS:-20}

echo "== virtual environment $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e "$ROOT[results,postgres]"
PY="$VENV/bin/python"

started_redis=""
cleanup() {
  [ -n "${pids:-}" ] && kill $pids 2>/dev/null || true
  [ -n "$started_redis" ] && kill "$started_redis" 2>/dev/null || true
}
trap cleanup EXIT
if [ -z "${EXAMPLE_REDIS_URL:-}" ]; then
  if "$PY" -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
    export EXAMPLE_REDIS_URL=redis://127.0.0.1:6379
  elif command -v redis-server >/dev/null; then
    port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
    started_redis=$!
    export EXAMPLE_REDIS_URL=redis://127.0.0.1:$port
    sleep 0.5
  else
    echo "No Redis on 127.0.0.1:6379 and no redis-server on PATH: apt-get install redis-server, or set EXAMPLE_REDIS_URL." >&2
    exit 2
  fi
fi
echo "== redis $EXAMPLE_REDIS_URL"
export EXAMPLE_SQLITE_PATH=${EXAMPLE_SQLITE_PATH:-$ROOT/example_project/example.sqlite3}
rm -f "$EXAMPLE_SQLITE_PATH"
"$PY" manage.py migrate -v 0
"$PY" -m celery -A example_project worker --loglevel WARNING --concurrency 1 >worker.log 2>&1 &
pids=$!
"$PY" -m celery -A example_project beat --loglevel INFO >beat.log 2>&1 &
pids="$pids $!"
echo "== beat (DriftSafeScheduler) and worker running for $SECONDS_TO_RUN s; logs: example_project/beat.log, worker.log"
sleep "$SECONDS_TO_RUN"
kill -TERM $pids; wait $pids 2>/dev/null || true
pids=""
"$PY" manage.py shell -c "
from collections import Counter
from celery_driftsafe.models import Run
rows = Counter((r.task_name, r.status) for r in Run.objects.all())
for (name, status), n in sorted(rows.items()):
    print(f'{name:<28} {status:<11} {n}')
slots = [(r.periodic_task_id, r.slot) for r in Run.objects.filter(kind='scheduled')]
print('runs:', len(slots), 'duplicate slots:', len(slots) - len(set(slots)))
raise SystemExit(0 if slots and len(slots) == len(set(slots)) else 1)
"
