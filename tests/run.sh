#!/usr/bin/env bash
# The test command (README.md gives it; .ci/run calls it):
#   fresh venv (services starting beside it) -> three lanes side by side:
#   pytest on PostgreSQL | ruff, import-linter, mypy, docs -> pytest on SQLite | the chaos test
#   (on a PostgreSQL cluster of its own) -> pytest on MariaDB (integration tests)
# It touches nothing outside its scratch folder and the loopback ports it picks: its Redis,
# PostgreSQL (two clusters: the chaos test restarts its own), MariaDB and RabbitMQ are servers of
# its own (tests/services.sh up), stopped and removed at the end, also on failure or Ctrl-C. It
# installs nothing and never runs as another user than its own but to start those servers as
# their users when run as root: what is missing fails the run at once, naming the command that
# installs it (bash tests/services.sh --install, which CI runs first).
# Knobs (README.md, Run the tests): DRIFTSAFE_TEST_REDIS_URL, DRIFTSAFE_TEST_POSTGRES_URL,
# DRIFTSAFE_TEST_MARIADB_URL, DRIFTSAFE_TEST_RABBITMQ_URL (an existing server instead of one of
# its own: the suite then keeps to databases it creates and Redis keys under its run's prefix,
# tests/settings.py), DRIFTSAFE_TEST_WORKERS (pytest-xdist workers a pass, default 3),
# DRIFTSAFE_VENV (default .venv-test), PYTHON (default python3), DRIFTSAFE_ALLOW_SKIPS; extra
# arguments go to every pytest run.
# A test that still finds something missing FAILS the run, saying what to install
# (tests/skip_guard.py), unless DRIFTSAFE_ALLOW_SKIPS=1 is set (then said at the top and the
# end of the run, and a pass that cannot run is named in the verdict: "MariaDB untested").
# Deliberate skips stay skips: PostgreSQL-only tests in the SQLite pass, a feature another
# database lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DRIFTSAFE_VENV:-.venv-test}
WORKERS=${DRIFTSAFE_TEST_WORKERS:-3}

say() { printf '\n== %s\n' "$*"; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 2; }
allowed_skips() { [ "${DRIFTSAFE_ALLOW_SKIPS:-}" = 1 ]; }
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

# -- what is missing fails the run now, not minutes into it ----------------------------------------
say "what the suite needs (tests/services.sh check)"
if ! bash tests/services.sh check; then
  allowed_skips || die "the suite needs what is listed above: install it with" \
    "bash tests/services.sh --install (as root or with sudo), or set DRIFTSAFE_ALLOW_SKIPS=1" \
    "to run without it (its tests then skip, and the run says so)"
  echo "WARNING: running without what is listed above (DRIFTSAFE_ALLOW_SKIPS=1)"
fi
has() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; }
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$PG_BIN" ] || PG_BIN=$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")
# The servers of the run's own: each one whose URL is not given, if it is installed.
SERVICES=()
[ -n "${DRIFTSAFE_TEST_REDIS_URL:-}" ] || { has redis-server || die "redis-server is not installed:" \
  "bash tests/services.sh --install (apt-get install redis-server)"; SERVICES+=(redis); }
[ -n "${DRIFTSAFE_TEST_POSTGRES_URL:-}" ] || { [ -x "$PG_BIN/initdb" ] || die "PostgreSQL's" \
  "initdb is not installed: bash tests/services.sh --install (apt-get install postgresql)"; SERVICES+=(postgres); }
if [ -z "${DRIFTSAFE_TEST_RABBITMQ_URL:-}" ]; then
  if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || has rabbitmq-server; then SERVICES+=(rabbitmq)
  else echo "WARNING: no RabbitMQ (DRIFTSAFE_ALLOW_SKIPS=1): the tests that use it fail or skip"; fi
fi
# The MariaDB pass: its server, and mysqlclient (the mysql extra; it builds against the MariaDB
# client libraries). Without them the run fails, or with DRIFTSAFE_ALLOW_SKIPS=1 it says
# "MariaDB untested" in its verdict.
MARIADB_UNTESTED=""
if [ -z "${DRIFTSAFE_TEST_MARIADB_URL:-}" ]; then
  if { has mariadbd || has mysqld; } && { has mariadb-install-db || has mysql_install_db; }; then
    SERVICES+=(mariadb)
  else
    MARIADB_UNTESTED="no MariaDB server (mariadbd, mariadb-install-db) to run it on"
  fi
fi
{ has mariadb_config || has mysql_config; } && has pkg-config && has cc \
  || MARIADB_UNTESTED="mysqlclient cannot be built (no MariaDB client headers, pkg-config or cc)"
if [ -n "$MARIADB_UNTESTED" ]; then
  allowed_skips || die "no MariaDB pass: $MARIADB_UNTESTED. bash tests/services.sh --install" \
    "installs what it needs, or DRIFTSAFE_ALLOW_SKIPS=1 runs without it"
  echo "WARNING: MariaDB untested: $MARIADB_UNTESTED (DRIFTSAFE_ALLOW_SKIPS=1)"
fi

# -- the scratch folder and the servers, started while the virtual environment is made -----------
scratch=$(mktemp -d "${TMPDIR:-/tmp}/driftsafe-run.XXXXXX")
# PostgreSQL, MariaDB and RabbitMQ run as their own users when the run is root: they pass through
if [ "$(id -u)" = 0 ]; then chmod 711 "$scratch"; fi
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
  bash tests/services.sh down "$scratch/services" 2>/dev/null || true
  bash tests/services.sh down "$scratch/chaos" 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# The run's name: its Redis keys' prefix and its databases' names hold it (tests/settings.py).
export DRIFTSAFE_TEST_RUN_ID=${DRIFTSAFE_TEST_RUN_ID:-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')}
# Five Redis databases a worker of each of the three passes (tests/settings.py).
DRIFTSAFE_TEST_REDIS_DATABASES=$((15 * WORKERS)) PYTHON="$PYTHON" \
  bash tests/services.sh up "$scratch/services" "${SERVICES[@]}" >"$scratch/services.env" \
  2>"$scratch/services.log" &
services_pid=$!
LANES+=("$services_pid")
# The chaos test's cluster: it restarts it (tests/e2e/test_chaos.py, DRIFTSAFE_TEST_PG_DATA).
PYTHON="$PYTHON" bash tests/services.sh up "$scratch/chaos" postgres >"$scratch/chaos.env" \
  2>"$scratch/chaos.log" &
chaos_services_pid=$!
LANES+=("$chaos_services_pid")

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
EXTRAS=""
[ -n "$MARIADB_UNTESTED" ] || EXTRAS="[mysql]"  # mysqlclient, the MariaDB pass's driver
"$VENV/bin/python" -m pip install -q --no-compile -e ".$EXTRAS" --group dev
"$VENV/bin/python" -m compileall -q -j 0 \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PY="$VENV/bin/python"

say "services of the run's own (tests/services.sh up: ${SERVICES[*]}; the chaos test's PostgreSQL)"
wait "$services_pid" || { cat "$scratch/services.log"; die "could not start the run's servers (above)"; }
wait "$chaos_services_pid" || { cat "$scratch/chaos.log"; die "could not start the chaos test's PostgreSQL (above)"; }
cat "$scratch/services.env"
set -a
# shellcheck disable=SC1091
. "$scratch/services.env"
set +a
[ -n "${DRIFTSAFE_TEST_MARIADB_URL:-}" ] || MARIADB_UNTESTED=${MARIADB_UNTESTED:-no MariaDB server}
if [ -z "$MARIADB_UNTESTED" ] && ! "$PY" -c "import MySQLdb" 2>/dev/null; then
  allowed_skips || die "mysqlclient (the MariaDB pass's driver) was installed but does not import"
  MARIADB_UNTESTED="mysqlclient does not import"
fi
# Each pass its own Redis databases on the run's own Redis (five a worker), and its own key prefix.
# On a Redis given by URL (not the run's own) the passes share the databases from
# DRIFTSAFE_TEST_REDIS_DB (default 0), told apart by their key prefixes.
private_redis=0
[ "${DRIFTSAFE_TEST_REDIS_PRIVATE:-}" != "${DRIFTSAFE_TEST_REDIS_URL:-}" ] || private_redis=1
first_db() {
  if [ "$private_redis" = 1 ]; then echo $(($1 * 5 * WORKERS)); else echo "${DRIFTSAFE_TEST_REDIS_DB:-0}"; fi
}
RUN_ID=$DRIFTSAFE_TEST_RUN_ID

# -- the checks and the passes, side by side where they use different resources ----------------
# Most of a pass is waiting (end-to-end runs wait for their slots), so three lanes overlap on two
# cores; each lane's resources are its own:
#   1. the PostgreSQL pass, on the run's PostgreSQL (its output below);
#   2. ruff, import-linter, mypy and the docs, then the SQLite pass;
#   3. the chaos test: it restarts PostgreSQL, so it gets a PostgreSQL cluster of its own
#      (DRIFTSAFE_TEST_PG_DATA; a Redis of its own it starts itself); then the end-to-end runs
#      behind PgBouncer (-m pgbouncer, on the run's PostgreSQL beside lane 1: their own
#      databases and run id; here rather than in lane 1, which is the longest); then the
#      MariaDB pass (it reuses the PgBouncer runs' Redis databases, one after the other).
# The passes share the run's Redis, RabbitMQ and MariaDB, each with Redis databases and a key
# prefix of its own (first_db, RUN_ID).
# Lanes 2 and 3 write to logs, shown once they are done. A failing step fails the run at the
# end, once every lane is done (failing checks stop lane 2 there).
# A test at a time to whichever worker is free (--maxschedchunk 1), end-to-end runs first
# (tests/conftest.py): no worker is left with a queue of long runs while the other idles.
# A crashed worker fails the run rather than being replaced (a replacement's Redis databases
# are unknown, tests/settings.py); its other tests go to the remaining workers.
# The slowest tests of each pass are listed at its end (--durations), for keeping the run short.
PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1 --max-worker-restart 0 --durations 15)

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

chaos() {
  local code=0
  # the chaos cluster's URL and data directory over the run's PostgreSQL
  ( set -a
    # shellcheck disable=SC1091
    . "$scratch/chaos.env"
    set +a
    DRIFTSAFE_TEST_DB=postgres DRIFTSAFE_TEST_REDIS_DB=0 DRIFTSAFE_TEST_RUN_ID="${RUN_ID}c" \
      "$PY" -m pytest -m chaos "$@" ) || code=$?
  # exit 5, nothing selected, is fine only when extra arguments deselected it
  if [ "$code" = 5 ] && [ $# -gt 0 ]; then return 0; fi
  return "$code"
}
pgbouncer() {
  local code=0
  DRIFTSAFE_TEST_DB=postgres DRIFTSAFE_TEST_REDIS_DB="$(first_db 2)" \
    DRIFTSAFE_TEST_RUN_ID="${RUN_ID}b" "$PY" -m pytest -m pgbouncer --durations 5 "$@" || code=$?
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
mariadb_pass() {
  [ -z "$MARIADB_UNTESTED" ] || return 0
  say "pytest on MariaDB (integration, not end-to-end; $WORKERS workers)"
  step mariadb env DRIFTSAFE_TEST_DB=mysql DRIFTSAFE_TEST_REDIS_DB="$(first_db 2)" \
    DRIFTSAFE_TEST_RUN_ID="${RUN_ID}m" \
    "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not e2e" "$@"
}
lane2() {
  step checks checks || return
  say "pytest on SQLite ($WORKERS workers)"
  step sqlite env DRIFTSAFE_TEST_DB=sqlite DRIFTSAFE_TEST_REDIS_DB="$(first_db 1)" \
    DRIFTSAFE_TEST_RUN_ID="${RUN_ID}s" "$PY" -m pytest "${PARALLEL[@]}" "$@"
}
lane3() {
  local code=0
  say "the chaos test (on a PostgreSQL cluster of its own)"
  step chaos chaos "$@" || code=$?
  say "pytest behind PgBouncer (end-to-end, on the run's PostgreSQL)"
  step pgbouncer pgbouncer "$@" || code=$?
  mariadb_pass "$@" || code=$?
  return "$code"
}
lane2 "$@" > "$scratch/lane2.log" 2>&1 &
lane2_pid=$!
LANES+=("$lane2_pid")
lane3 "$@" > "$scratch/lane3.log" 2>&1 &
lane3_pid=$!
LANES+=("$lane3_pid")
say "pytest on PostgreSQL ($WORKERS workers; beside it: the checks and the SQLite pass, the" \
  "chaos test, the runs behind PgBouncer and the MariaDB pass; their output follows)"
pg_code=0
# in the background and waited for: a TERM to the command then stops it at once (bash runs a
# trap only once its foreground command is done)
step postgres env DRIFTSAFE_TEST_DB=postgres DRIFTSAFE_TEST_REDIS_DB="$(first_db 0)" \
  DRIFTSAFE_TEST_RUN_ID="${RUN_ID}p" \
  "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not chaos and not pgbouncer" "$@" &
pg_pid=$!
LANES+=("$pg_pid")
wait "$pg_pid" || pg_code=$?
lane2_code=0
wait "$lane2_pid" || lane2_code=$?
cat "$scratch/lane2.log"
lane3_code=0
wait "$lane3_pid" || lane3_code=$?
cat "$scratch/lane3.log"
mapfile -t steps < "$scratch/steps"
untested=""
[ -z "$MARIADB_UNTESTED" ] || untested="; MariaDB untested ($MARIADB_UNTESTED)"
failed=$(grep -c FAILED "$scratch/steps" || true)
if [ "$failed" != 0 ] || [ "$pg_code" != 0 ] || [ "$lane2_code" != 0 ] \
    || [ "$lane3_code" != 0 ]; then
  allow_skips_note
  say "FAILED after $SECONDS s: ${steps[*]}$untested"
  exit 1
fi
allow_skips_note
say "passed in $SECONDS s; pytest: ${steps[*]}$untested"
