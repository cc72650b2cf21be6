#!/usr/bin/env bash
# Side-by-side benchmark of celery_driftsafe, django-celery-beat and RedBeat (docs/comparison.md):
# builds .venv-bench with the peers, then runs `python -m benchmarks compare` (benchmarks/README.md).
#   bash benchmarks/compare.sh            # the published run (about 35 minutes on 2 cores)
#   bash benchmarks/compare.sh --quick    # every scenario at small sizes (a few minutes)
#   bash benchmarks/compare.sh --help     # pick scenarios, sizes, bounds
# Needs PostgreSQL (DRIFTSAFE_TEST_POSTGRES_URL; eval "$(bash tests/services.sh up)" starts one),
# redis-server (the run starts its own broker and schedule store; without it, the Redis database
# DRIFTSAFE_BENCH_REDIS_URL names, if set) and libfaketime (Debian package
# faketime, plus gcc for its shim). The peers are installed into .venv-bench only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DRIFTSAFE_BENCH_VENV:-.venv-bench}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
echo "== installing celery_driftsafe and the peers into $VENV"
"$VENV/bin/python" -m pip install -q -e '.[postgres]' \
  'django-celery-beat>=2.6' 'celery-redbeat>=2.2' 'matplotlib>=3.7'

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
missing=()
ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 || missing+=(faketime)
command -v cc >/dev/null || missing+=(gcc libc6-dev)
command -v redis-server >/dev/null || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]} (clock skew, the run's own Redis servers)"
  { as_root apt-get update -qq && as_root apt-get install -y -qq "${missing[@]}" >/dev/null; } \
    || echo "WARNING: could not install ${missing[*]}; see docs/comparison.md for what needs them"
fi

exec "$VENV/bin/python" -m benchmarks compare "$@"
