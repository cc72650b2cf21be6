#!/usr/bin/env bash
# Service provisioning for the test suite (tests/run.sh calls it; it can also run alone):
# Redis, PostgreSQL, RabbitMQ (the chaos test's broker) and MariaDB when it is installed, up and
# listening; the Debian packages the end-to-end, clock-skew and chaos tests need (libfaketime, a
# C compiler, Chromium and its driver, RabbitMQ, the Redis and PostgreSQL tools), installed once
# when missing (installing needs root or sudo). A test whose tool is still missing fails the run
# and says what to install (tests/skip_guard.py), unless DRIFTSAFE_ALLOW_SKIPS=1.
# Environment knobs: PYTHON (default python3), DRIFTSAFE_TEST_PG_HOST/PORT,
# DRIFTSAFE_TEST_REDIS_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PG_HOST=${DRIFTSAFE_TEST_PG_HOST:-127.0.0.1}
PG_PORT=${DRIFTSAFE_TEST_PG_PORT:-5432}
REDIS_URL=${DRIFTSAFE_TEST_REDIS_URL:-redis://127.0.0.1:6379}

die() { printf '\nERROR: %s\n' "$*" >&2; exit 2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

port_open() { "$PY" - "$1" "$2" <<'PYEOF'
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PYEOF
}
wait_port() { for _ in $(seq 1 60); do port_open "$1" "$2" && return 0; sleep 0.5; done; return 1; }

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
# Chromium and its driver (the admin browser test), RabbitMQ, PgBouncer, openssl (the Redis TLS
# test), the MariaDB client libraries (mysqlclient builds against them) and the Redis and
# PostgreSQL tools (the chaos test restarts PostgreSQL and a redis-server of its own; the lock
# tests start redis-server and redis-sentinel). Installed once when missing; a test whose tool
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
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || apt_missing+=(pgbouncer)
command -v pgrep >/dev/null || apt_missing+=(procps)
command -v openssl >/dev/null || apt_missing+=(openssl)  # the Redis TLS test's certificate
# mysqlclient (the MariaDB pass's driver, when a server runs) builds against the client libraries
if port_open 127.0.0.1 3306 || command -v mariadbd >/dev/null; then
  command -v mariadb_config >/dev/null || command -v mysql_config >/dev/null \
    || apt_missing+=(libmariadb-dev pkg-config)
fi
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
if ! port_open 127.0.0.1 3306 && command -v mariadbd >/dev/null; then
  echo "starting MariaDB"
  as_root start-stop-daemon --start --oknodo --background --exec "$(command -v mariadbd)" || true
  wait_port 127.0.0.1 3306 || true
fi
