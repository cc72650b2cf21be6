#!/usr/bin/env bash
# The test command (README.md gives it; .ci/run calls it):
#   fresh venv -> services -> three lanes side by side (each with resources of its own):
#   pytest on PostgreSQL | ruff, import-linter, mypy, docs -> pytest on SQLite -> pytest on MariaDB
#   (integration, when one runs) | the chaos test on a PostgreSQL cluster of its own
# The pytest passes run on DRIFTSAFE_TEST_WORKERS pytest-xdist workers (default 3): the
# end-to-end tests mostly wait for slots to come, so they overlap well even on two cores.
# Environment knobs: DRIFTSAFE_VENV (default .venv-test), PYTHON (default python3),
# DRIFTSAFE_TEST_PG_HOST/PORT/USER, DRIFTSAFE_TEST_REDIS_URL, DRIFTSAFE_TEST_REDIS_DB (first
# Redis database of the PostgreSQL pass; each worker takes five, see tests/settings.py),
# DRIFTSAFE_TEST_WORKERS; extra args go to every pytest run.
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

# -- the checks and the passes, side by side where they use different resources ----------------
# Most of a pass is waiting (end-to-end runs wait for their slots), so three lanes overlap on two
# cores; each lane's resources are its own:
#   1. the PostgreSQL pass, on the machine's PostgreSQL and the test Redis (its output below);
#   2. ruff, import-linter, mypy and the docs, then the SQLite pass, on a Redis server of the run's own;
#   3. the chaos test: it restarts PostgreSQL, so it gets a PostgreSQL cluster of the run's own
#      (initdb, DRIFTSAFE_TEST_PG_DATA; a Redis of its own it starts itself); then the MariaDB
#      pass, on the run's own Redis too (five databases a worker: SQLite's from 0, MariaDB's
#      after them). Without initdb the chaos test runs after the PostgreSQL pass, on the
#      machine's PostgreSQL (as root), and the MariaDB pass after the SQLite pass.
# Lanes 2 and 3 write to logs, shown once they are done. A failing step fails the run at the
# end, once every lane is done (failing checks stop lane 2 there).
# A test at a time to whichever worker is free (--maxschedchunk 1), end-to-end runs first
# (tests/conftest.py): no worker is left with a queue of long runs while the other idles.
# A crashed worker fails the run rather than being replaced (a replacement's Redis databases
# are unknown, tests/settings.py); its other tests go to the remaining workers.
# The slowest tests of each pass are listed at its end (--durations), for keeping the run short.
PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1 --max-worker-restart 0 --durations 15)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/driftsafe-run.XXXXXX")
LANE_REDIS_PORT=""
CHAOS_PG=""
LANES=()
# a lane's processes, children first (on an early exit, say Ctrl-C, which background jobs ignore)
stop_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null || true); do stop_tree "$child"; done
  kill -TERM "$1" 2>/dev/null || true
}
cleanup() {
  local lane
  for lane in "${LANES[@]}"; do
    if kill -0 "$lane" 2>/dev/null; then stop_tree "$lane"; fi
  done
  if [ -n "$LANE_REDIS_PORT" ]; then
    redis-cli -p "$LANE_REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  fi
  if [ -n "$CHAOS_PG" ]; then
    as_postgres "$PG_BIN/pg_ctl" -D "$CHAOS_PG/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  rm -rf "$scratch"
}
trap cleanup EXIT
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# step NAME COMMAND...: runs it; its time (and failure) goes to the run's summary
step() {
  local name=$1 began=$SECONDS code=0
  shift
  "$@" || code=$?
  if [ "$code" = 0 ]; then
    echo "$name $((SECONDS - began)) s" >> "$scratch/steps"
  else
    echo "$name $((SECONDS - began)) s FAILED (exit code $code)" >> "$scratch/steps"
  fi
  return "$code"
}

# Lane 2's Redis: five databases a worker of each of its two passes, nothing on disk, gone at
# the end.
command -v redis-server >/dev/null || die "redis-server is not installed (tests/services.sh installs it)"
for _ in 1 2 3; do  # a free port can be taken between the look-up and the start
  port=$(free_port)
  if redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --databases $((10 * WORKERS)) \
      --daemonize yes --dir "$scratch" --logfile "$scratch/redis.log" >/dev/null; then
    for _ in $(seq 1 50); do port_open 127.0.0.1 "$port" && LANE_REDIS_PORT=$port && break; sleep 0.1; done
  fi
  [ -z "$LANE_REDIS_PORT" ] || break
done
[ -n "$LANE_REDIS_PORT" ] || die "could not start a redis-server of the run's own; see $scratch/redis.log"
LANE_REDIS="redis://127.0.0.1:$LANE_REDIS_PORT"

# Lane 3's PostgreSQL cluster (the chaos test restarts it): trust auth on a free loopback port,
# run as the postgres user when the run is root (PostgreSQL refuses to run as root).
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$PG_BIN" ] || PG_BIN=$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")
as_postgres() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
if [ -x "$PG_BIN/initdb" ] && { [ "$(id -u)" != 0 ] || id postgres >/dev/null 2>&1; }; then
  CHAOS_PG="$scratch/chaos-pg"
  CHAOS_PG_PORT=$(free_port)
  mkdir -p "$CHAOS_PG"
  if [ "$(id -u)" = 0 ]; then chmod 711 "$scratch" && chown postgres "$CHAOS_PG"; fi
  if ! { as_postgres "$PG_BIN/initdb" -D "$CHAOS_PG/data" -A trust -U postgres --no-sync \
           -E UTF8 >"$scratch/initdb.log" 2>&1 \
         && as_postgres "$PG_BIN/pg_ctl" -D "$CHAOS_PG/data" -l "$CHAOS_PG/data.log" -w \
           -o "-p $CHAOS_PG_PORT -k $CHAOS_PG -c listen_addresses=127.0.0.1 -c fsync=off" \
           start >>"$scratch/initdb.log" 2>&1; }; then
    cat "$scratch/initdb.log" "$CHAOS_PG/data.log" 2>/dev/null || true
    CHAOS_PG=""
    echo "NOTE: could not start a PostgreSQL cluster for the chaos test: it runs after the" \
      "PostgreSQL pass, on the machine's PostgreSQL"
  fi
fi

chaos() {
  local code=0
  if [ -n "$CHAOS_PG" ]; then
    DRIFTSAFE_TEST_DB=postgres DRIFTSAFE_TEST_PG_HOST=127.0.0.1 DRIFTSAFE_TEST_PG_PORT="$CHAOS_PG_PORT" \
      DRIFTSAFE_TEST_PG_USER=postgres DRIFTSAFE_TEST_PG_DATA="$CHAOS_PG/data" \
      "$PY" -m pytest -m chaos "$@" || code=$?
  else
    DRIFTSAFE_TEST_DB=postgres "$PY" -m pytest -m chaos "$@" || code=$?
  fi
  # exit 5, nothing selected, is fine only when extra arguments deselected it
  if [ "$code" = 5 ] && [ $# -gt 0 ]; then return 0; fi
  return "$code"
}
# The same commands as tox's lint, type and docs environments.
checks() {
  say "ruff and import-linter (tox -e lint)" && "$VENV/bin/ruff" check . \
    && "$VENV/bin/ruff" format --check . \
    && "$VENV/bin/lint-imports" \
    && say "mypy (tox -e type)" && "$VENV/bin/mypy" \
    && say "docs (tox -e docs; Sphinx, warnings are errors)" \
    && "$VENV/bin/sphinx-build" -W -q -b html docs docs/_build/html
}
mysql_pass() {
  [ "$MYSQL_PASS" = 1 ] || return 0
  say "pytest on MySQL/MariaDB (integration, not end-to-end; $WORKERS workers)"
  step mysql env DRIFTSAFE_TEST_DB=mysql DRIFTSAFE_TEST_REDIS_URL="$LANE_REDIS" \
    DRIFTSAFE_TEST_REDIS_DB=$((5 * WORKERS)) \
    "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not e2e" "$@"
}
lane2() {
  step checks checks || return
  say "pytest on SQLite ($WORKERS workers)"
  step sqlite env DRIFTSAFE_TEST_DB=sqlite DRIFTSAFE_TEST_REDIS_URL="$LANE_REDIS" \
    DRIFTSAFE_TEST_REDIS_DB=0 "$PY" -m pytest "${PARALLEL[@]}" "$@" || return
  [ -n "$CHAOS_PG" ] || mysql_pass "$@"
}
lane3() {
  local code=0
  say "the chaos test (on a PostgreSQL cluster of its own, port $CHAOS_PG_PORT)"
  step chaos chaos "$@" || code=$?
  mysql_pass "$@" || code=$?
  return "$code"
}
lane2 "$@" > "$scratch/lane2.log" 2>&1 &
lane2_pid=$!
LANES+=("$lane2_pid")
lane3_code=0
if [ -n "$CHAOS_PG" ]; then
  lane3 "$@" > "$scratch/lane3.log" 2>&1 &
  lane3_pid=$!
  LANES+=("$lane3_pid")
fi
say "pytest on PostgreSQL ($WORKERS workers; beside it: the checks and the SQLite pass, the" \
  "chaos test and the MariaDB pass; their output follows)"
pg_code=0
step postgres env DRIFTSAFE_TEST_DB=postgres \
  "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not chaos" "$@" || pg_code=$?
if [ -z "$CHAOS_PG" ]; then
  say "pytest on PostgreSQL: the chaos test (restarts PostgreSQL and its own Redis)"
  step chaos chaos "$@" || true
fi
lane2_code=0
wait "$lane2_pid" || lane2_code=$?
cat "$scratch/lane2.log"
if [ -n "$CHAOS_PG" ]; then
  wait "$lane3_pid" || lane3_code=$?
  cat "$scratch/lane3.log"
fi
mapfile -t steps < "$scratch/steps"
failed=$(grep -c FAILED "$scratch/steps" || true)
if [ "$failed" != 0 ] || [ "$pg_code" != 0 ] || [ "$lane2_code" != 0 ] \
    || [ "$lane3_code" != 0 ]; then
  say "FAILED after $SECONDS s: ${steps[*]}"
  [ -z "$MYSQL_NOTE" ] || echo "NOTE: $MYSQL_NOTE"
  allow_skips_note
  exit 1
fi
say "passed in $SECONDS s; pytest: ${steps[*]}"
[ -z "$MYSQL_NOTE" ] || echo "NOTE: $MYSQL_NOTE"
allow_skips_note
