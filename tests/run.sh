#!/usr/bin/env bash
# The test command (README.md gives it; .ci/run calls it):
#   fresh venv -> services -> ruff, import-linter -> mypy -> docs -> pytest on SQLite -> pytest on PostgreSQL
#   -> pytest on MariaDB (integration, when one runs) with the chaos test on PostgreSQL beside it
# The pytest passes run on DRIFTSAFE_TEST_WORKERS pytest-xdist workers (default 3): the
# end-to-end tests mostly wait for slots to come, so three overlap well even on two cores.
# The chaos test restarts PostgreSQL (and a Redis of its own), so no other PostgreSQL test runs
# beside it: it runs after the PostgreSQL pass, beside the MariaDB pass (or alone without one).
# Environment knobs: DRIFTSAFE_VENV (default .venv-test), PYTHON (default python3),
# DRIFTSAFE_TEST_PG_HOST/PORT/USER, DRIFTSAFE_TEST_REDIS_URL, DRIFTSAFE_TEST_REDIS_DB (first
# Redis database; each worker takes five, see tests/settings.py), DRIFTSAFE_TEST_WORKERS;
# extra args go to every pytest run.
# tests/services.sh provisions what the end-to-end, clock-skew and chaos tests need (Redis,
# PostgreSQL, RabbitMQ, MariaDB; libfaketime, a C compiler, Chromium, the Redis and PostgreSQL
# tools; installing needs root or sudo).
# A test that still finds something missing FAILS the run, saying what to install
# (tests/skip_guard.py), unless DRIFTSAFE_ALLOW_SKIPS=1 is set (then said at the top and the
# end of the run). Deliberate skips stay skips: PostgreSQL-only tests in the SQLite pass, a
# feature another database lacks. When a MariaDB/MySQL server runs, its pass runs: a
# mysqlclient that cannot be installed fails the run (unless DRIFTSAFE_ALLOW_SKIPS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DRIFTSAFE_VENV:-.venv-test}
WORKERS=${DRIFTSAFE_TEST_WORKERS:-3}

say() { printf '\n== %s\n' "$*"; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 2; }
# DRIFTSAFE_ALLOW_SKIPS (inherited from the environment) changes what a passing run means: never
# silently. Shown here, and again at the end (and by every pytest pass, tests/skip_guard.py).
allow_skips_note() {
  if [ -n "${DRIFTSAFE_ALLOW_SKIPS+set}" ]; then
    if [ "$DRIFTSAFE_ALLOW_SKIPS" = 1 ]; then
      echo "NOTE: DRIFTSAFE_ALLOW_SKIPS=1 is set: tests may skip for what is missing (each pass lists them)"
    else
      echo "NOTE: DRIFTSAFE_ALLOW_SKIPS=$DRIFTSAFE_ALLOW_SKIPS is set: no effect (only 1 allows skips)"
    fi
  fi
}
allow_skips_note
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

say "virtual environment $VENV (fresh)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# the package, and what the suite needs (the dependency groups, pip >= 25.1: the user extras
# it exercises and the tools);
# then its bytecode, on every core (pip compiles on one: 10 s more here). The bytecode must be
# written now: where PYTHONDONTWRITEBYTECODE is set (CI sets it) nothing writes it later, and
# every beat and worker the end-to-end tests start would compile Django, Celery and kombu
# again (tried: the PostgreSQL pass went from 351 to 486 s, four tests late).
"$VENV/bin/python" -m pip install -q --no-compile -e . --group dev
"$VENV/bin/python" -m compileall -q -j 0 \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PY="$VENV/bin/python"

say "services (tests/services.sh)"
PYTHON="$PY" bash tests/services.sh

port_open() { "$PY" - "$1" "$2" <<'PYEOF'
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PYEOF
}

# MySQL/MariaDB pass (integration tests, not end-to-end): when a server runs.
MYSQL_PASS=0
MYSQL_NOTE=""
if port_open 127.0.0.1 3306; then
  if ! "$PY" -c "import MySQLdb" 2>/dev/null; then
    command -v mariadb_config >/dev/null || command -v mysql_config >/dev/null \
      || { as_root apt-get install -y -qq libmariadb-dev pkg-config >/dev/null 2>&1 || true; }
    "$PY" -m pip install -q -e '.[mysql]' --group dev || true
  fi
  if "$PY" -c "import MySQLdb" 2>/dev/null; then
    MYSQL_PASS=1
  elif [ "${DRIFTSAFE_ALLOW_SKIPS:-}" = 1 ]; then
    echo "WARNING: a MariaDB/MySQL server runs on 127.0.0.1:3306 but mysqlclient could not be" \
      "installed: the MariaDB pass is dropped (DRIFTSAFE_ALLOW_SKIPS=1)"
    MYSQL_NOTE="the MariaDB pass was dropped: mysqlclient could not be installed"
  else
    die "a MariaDB/MySQL server runs on 127.0.0.1:3306, but mysqlclient (the driver of its test" \
      "pass) could not be installed. It builds against the MariaDB client libraries: install" \
      "them (apt-get install libmariadb-dev pkg-config gcc) and run again, or set" \
      "DRIFTSAFE_ALLOW_SKIPS=1 to run without the MariaDB pass."
  fi
else
  MYSQL_NOTE="no MySQL/MariaDB server on 127.0.0.1:3306: no MariaDB pass"
  echo "NOTE: $MYSQL_NOTE"
fi

# The same commands as tox's lint, type and docs environments.
say "ruff and import-linter (tox -e lint)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# the layers' contracts and no import cycle (pyproject.toml, [tool.importlinter])
"$VENV/bin/lint-imports"
say "mypy (tox -e type)"
"$VENV/bin/mypy"
say "docs (tox -e docs; Sphinx, warnings are errors)"
"$VENV/bin/sphinx-build" -W -q -b html docs docs/_build/html
# A test at a time to whichever worker is free (--maxschedchunk 1), end-to-end runs first
# (tests/conftest.py): no worker is left with a queue of long runs while the other idles.
# A crashed worker fails the run rather than being replaced (a replacement's Redis databases
# are unknown, tests/settings.py); its other tests go to the remaining workers.
# The slowest tests of each pass are listed at its end (--durations), for keeping the run short.
PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1 --max-worker-restart 0 --durations 15)
passes=()
timed() {
  local name=$1 began=$SECONDS code=0
  shift
  "$@" || code=$?
  passes+=("$name $((SECONDS - began)) s")
  return "$code"
}
say "pytest on SQLite ($WORKERS workers)"
timed sqlite env DRIFTSAFE_TEST_DB=sqlite "$PY" -m pytest "${PARALLEL[@]}" "$@"
say "pytest on PostgreSQL ($WORKERS workers; the chaos test later)"
timed postgres env DRIFTSAFE_TEST_DB=postgres \
  "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not chaos" "$@"
chaos() {
  local code=0
  DRIFTSAFE_TEST_DB=postgres "$PY" -m pytest -m chaos "$@" || code=$?
  # exit 5, nothing selected, is fine only when extra arguments deselected it
  if [ "$code" = 5 ] && [ $# -gt 0 ]; then return 0; fi
  return "$code"
}
if [ "$MYSQL_PASS" = 1 ]; then
  # The chaos test uses no MariaDB and no Redis of the machine's, and the MariaDB pass no
  # PostgreSQL: they run side by side (about 100 s saved), the chaos test's output after.
  say "pytest on MySQL/MariaDB (integration, not end-to-end; $WORKERS workers), and beside it" \
    "the chaos test on PostgreSQL (restarts PostgreSQL and its own Redis)"
  chaos_log=$(mktemp)
  chaos_began=$SECONDS
  chaos "$@" > "$chaos_log" 2>&1 &
  chaos_pid=$!
  mysql_code=0
  timed mysql env DRIFTSAFE_TEST_DB=mysql \
    "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not e2e" "$@" || mysql_code=$?
  chaos_code=0
  wait "$chaos_pid" || chaos_code=$?
  passes+=("chaos $((SECONDS - chaos_began)) s")
  say "the chaos test (exit code $chaos_code)"
  cat "$chaos_log"
  rm -f "$chaos_log"
  [ "$mysql_code" = 0 ] || die "the MySQL/MariaDB pass failed (exit code $mysql_code)"
  [ "$chaos_code" = 0 ] || die "the chaos test failed (exit code $chaos_code)"
else
  say "pytest on PostgreSQL: the chaos test (restarts PostgreSQL and its own Redis)"
  timed chaos chaos "$@"
fi
say "passed in $SECONDS s; pytest: ${passes[*]}"
[ -z "$MYSQL_NOTE" ] || echo "NOTE: $MYSQL_NOTE"
allow_skips_note
