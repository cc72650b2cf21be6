#!/usr/bin/env bash
# The test command (README.md gives it; .ci/run calls it):
#   fresh venv -> services -> ruff -> mypy -> docs -> pytest on SQLite -> pytest on PostgreSQL
#   -> the chaos test alone on PostgreSQL -> pytest on MariaDB (integration, when one runs)
# The pytest passes run on DRIFTSAFE_TEST_WORKERS pytest-xdist workers (default 3): the
# end-to-end tests mostly wait for slots to come, so three overlap well even on two cores.
# The chaos test restarts PostgreSQL and Redis, so it runs alone, after the parallel passes.
# Environment knobs: DRIFTSAFE_VENV (default .venv-test), PYTHON (default python3),
# DRIFTSAFE_TEST_PG_HOST/PORT/USER, DRIFTSAFE_TEST_REDIS_URL, DRIFTSAFE_TEST_REDIS_DB (first
# Redis database; each worker takes five, see tests/settings.py), DRIFTSAFE_TEST_WORKERS;
# extra args go to every pytest run.
# It provisions what the end-to-end, clock-skew and chaos tests need (libfaketime, a C
# compiler, Chromium, RabbitMQ, the Redis and PostgreSQL tools; installing needs root or sudo).
# Such a test that still finds something missing FAILS the run, saying what to install
# (tests/skip_guard.py), unless DRIFTSAFE_ALLOW_SKIPS=1 is set. Deliberate skips stay skips:
# PostgreSQL-only tests in the SQLite pass, the soak tests without --run-slow.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DRIFTSAFE_VENV:-.venv-test}
PG_HOST=${DRIFTSAFE_TEST_PG_HOST:-127.0.0.1}
PG_PORT=${DRIFTSAFE_TEST_PG_PORT:-5432}
REDIS_URL=${DRIFTSAFE_TEST_REDIS_URL:-redis://127.0.0.1:6379}
WORKERS=${DRIFTSAFE_TEST_WORKERS:-3}

say() { printf '\n== %s\n' "$*"; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

say "virtual environment $VENV (fresh)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[test]'
PY="$VENV/bin/python"

port_open() { "$PY" - "$1" "$2" <<'PYEOF'
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PYEOF
}
wait_port() { for _ in $(seq 1 60); do port_open "$1" "$2" && return 0; sleep 0.5; done; return 1; }

say "services"
redis_host_port=${REDIS_URL#redis://}
redis_host=${redis_host_port%%:*}; redis_port=${redis_host_port##*:}
if ! port_open "$redis_host" "$redis_port"; then
  command -v redis-server >/dev/null || die "Redis is not running on $redis_host:$redis_port and redis-server is not installed. Install it (apt-get install redis-server) or point DRIFTSAFE_TEST_REDIS_URL at a running Redis."
  echo "starting redis-server on $redis_host:$redis_port"
  mkdir -p /tmp/driftsafe-redis
  redis-server --daemonize yes --bind "$redis_host" --port "$redis_port" --save "" --appendonly no \
    --dir /tmp/driftsafe-redis --logfile /tmp/driftsafe-redis/redis.log
  wait_port "$redis_host" "$redis_port" || die "redis-server did not come up; see /tmp/driftsafe-redis/redis.log"
fi
echo "redis: $redis_host:$redis_port up"
if ! port_open "$PG_HOST" "$PG_PORT"; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "starting PostgreSQL"
    as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start \
      || die "could not start PostgreSQL with pg_ctlcluster"
    wait_port "$PG_HOST" "$PG_PORT" || die "PostgreSQL did not come up on $PG_HOST:$PG_PORT"
  else
    die "PostgreSQL is not running on $PG_HOST:$PG_PORT. Install it (apt-get install postgresql) and start it, or set DRIFTSAFE_TEST_PG_HOST/PORT/USER to a server that trusts the test user."
  fi
fi
echo "postgresql: $PG_HOST:$PG_PORT up"
# Debian packages some tests need: libfaketime and a C compiler for its shim (clock skew),
# Chromium and its driver (the admin browser test), RabbitMQ and the Redis and PostgreSQL
# tools (the chaos test restarts the services). Installed once when missing; a test whose tool
# is still missing fails the run and says what to install (unless DRIFTSAFE_ALLOW_SKIPS=1).
apt_missing=()
ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 || apt_missing+=(faketime)
command -v cc >/dev/null || apt_missing+=(gcc libc6-dev)
command -v chromium >/dev/null || apt_missing+=(chromium fonts-dejavu-core)
command -v chromedriver >/dev/null || apt_missing+=(chromium-driver)
command -v rabbitmq-server >/dev/null || [ -x /usr/sbin/rabbitmq-server ] || apt_missing+=(rabbitmq-server)
command -v redis-cli >/dev/null || apt_missing+=(redis-tools)
command -v redis-server >/dev/null || apt_missing+=(redis-server)
command -v redis-sentinel >/dev/null || apt_missing+=(redis-sentinel)
command -v pg_ctlcluster >/dev/null || apt_missing+=(postgresql-common)
command -v pgrep >/dev/null || apt_missing+=(procps)
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${apt_missing[*]}"
  { as_root apt-get update -qq && as_root apt-get install -y -qq "${apt_missing[@]}" >/dev/null; } \
    || echo "WARNING: could not install ${apt_missing[*]}; tests that need them will fail, saying what is missing"
fi

# RabbitMQ: the chaos test's broker (it survives the Redis restart the test makes).
if ! port_open 127.0.0.1 5672; then
  RABBITMQ=$(command -v rabbitmq-server || echo /usr/sbin/rabbitmq-server)
  if [ -x "$RABBITMQ" ]; then
    echo "starting RabbitMQ"
    as_root "$RABBITMQ" -detached || echo "WARNING: could not start RabbitMQ"
    for _ in $(seq 1 120); do port_open 127.0.0.1 5672 && break; sleep 0.5; done
  fi
fi
if port_open 127.0.0.1 5672; then echo "rabbitmq: 127.0.0.1:5672 up"
else echo "WARNING: RabbitMQ is not running on 127.0.0.1:5672; the chaos test will fail saying so"; fi

# MySQL/MariaDB pass (integration tests, not end-to-end): when a server runs or can be started.
MYSQL_PASS=0
if ! port_open 127.0.0.1 3306 && command -v mariadbd >/dev/null; then
  echo "starting MariaDB"
  as_root start-stop-daemon --start --oknodo --background --exec "$(command -v mariadbd)" || true
  wait_port 127.0.0.1 3306 || true
fi
if port_open 127.0.0.1 3306; then
  if ! "$PY" -c "import MySQLdb" 2>/dev/null; then
    command -v mariadb_config >/dev/null || command -v mysql_config >/dev/null \
      || { as_root apt-get install -y -qq libmariadb-dev pkg-config >/dev/null 2>&1 || true; }
    "$PY" -m pip install -q -e '.[test,mysql]' || true
  fi
  "$PY" -c "import MySQLdb" 2>/dev/null && MYSQL_PASS=1
fi
[ "$MYSQL_PASS" = 1 ] || echo "NOTE: no MySQL/MariaDB on 127.0.0.1:3306 (or no mysqlclient): skipping the MySQL pass"

say "ruff"
"$VENV/bin/ruff" check .
say "mypy"
"$VENV/bin/mypy"
say "docs (Sphinx, warnings are errors)"
"$VENV/bin/sphinx-build" -W -q -b html docs docs/_build/html
# A test at a time to whichever worker is free (--maxschedchunk 1), end-to-end runs first
# (tests/conftest.py): no worker is left with a queue of long runs while the other idles.
# A crashed worker fails the run rather than being replaced (a replacement's Redis databases
# are unknown, tests/settings.py); its other tests go to the remaining workers.
PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1 --max-worker-restart 0)
passes=()
timed() { local name=$1 began=$SECONDS; shift; "$@"; passes+=("$name $((SECONDS - began)) s"); }
say "pytest on SQLite ($WORKERS workers)"
timed sqlite env DRIFTSAFE_TEST_DB=sqlite "$PY" -m pytest "${PARALLEL[@]}" "$@"
say "pytest on PostgreSQL ($WORKERS workers; the chaos test next, alone)"
timed postgres env DRIFTSAFE_TEST_DB=postgres \
  "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not chaos" "$@"
say "pytest on PostgreSQL: the chaos test (restarts PostgreSQL and Redis), alone"
chaos() {
  local code=0
  DRIFTSAFE_TEST_DB=postgres "$PY" -m pytest -m chaos "$@" || code=$?
  # exit 5, nothing selected, is fine only when extra arguments deselected it
  if [ "$code" = 5 ] && [ $# -gt 0 ]; then return 0; fi
  return "$code"
}
timed chaos chaos "$@"
if [ "$MYSQL_PASS" = 1 ]; then
  say "pytest on MySQL/MariaDB (integration, not end-to-end; $WORKERS workers)"
  timed mysql env DRIFTSAFE_TEST_DB=mysql \
    "$PY" -m pytest "${PARALLEL[@]}" -m "not pure and not e2e" "$@"
fi
say "passed in $SECONDS s; pytest: ${passes[*]}"
