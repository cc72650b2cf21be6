#!/usr/bin/env bash
# The test suite's servers, of its own: Redis, PostgreSQL, MariaDB and RabbitMQ on free loopback
# ports, with their data, sockets and logs in one folder. Nothing of the machine's own servers is
# read, written or started, and nothing is installed unless asked.
#
#   eval "$(bash tests/services.sh up)"   start them in a new folder; prints the exports pytest
#                                         reads (DRIFTSAFE_TEST_*_URL ...; tests/settings.py)
#   bash tests/services.sh down           stop them, remove the folder ($DRIFTSAFE_TEST_SERVICES)
#   bash tests/services.sh up DIR [redis|postgres|mariadb|rabbitmq ...]
#                                         into DIR (made if need be): tests/run.sh's form. With no
#                                         names, every service whose URL variable is not set
#                                         (DRIFTSAFE_TEST_REDIS_URL, _POSTGRES_URL, _MARIADB_URL,
#                                         _RABBITMQ_URL: an existing server, passed on as given)
#   bash tests/services.sh down DIR
#   bash tests/services.sh check          what the suite needs and is missing (exit 1), with the
#                                         command that installs it
#   bash tests/services.sh --install      install what is missing (apt-get; as root or with sudo):
#                                         the only command here that installs; .ci/run runs it
#
# Environment: PYTHON (default python3; only for finding free ports and parsing URLs),
# DRIFTSAFE_TEST_REDIS_DATABASES (the private Redis's database count, default 64).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

say() { printf '%s\n' "$*" >&2; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 2; }
is_root() { [ "$(id -u)" = 0 ]; }

# -- what the suite needs: a test for each tool, and the Debian package that brings it ----------
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$PG_BIN" ] || PG_BIN=$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")
MARIADBD=$(command -v mariadbd || command -v mysqld || ls /usr/sbin/mariadbd 2>/dev/null || true)
INSTALL_DB=$(command -v mariadb-install-db || command -v mysql_install_db || true)
RABBITMQ=/usr/lib/rabbitmq/bin/rabbitmq-server  # Debian's; /usr/sbin's wrapper su's to rabbitmq
[ -x "$RABBITMQ" ] || RABBITMQ=$(command -v rabbitmq-server || echo /nonexistent/rabbitmq-server)

has() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; }
# needs: "NAME%TEST%PACKAGES" lines; TEST is a shell condition
needs() {
  cat <<'EOF'
redis-server%has redis-server%redis-server
redis-cli%has redis-cli%redis-tools
redis-sentinel%has redis-sentinel%redis-sentinel
PostgreSQL's initdb and pg_ctl%[ -x "$PG_BIN/initdb" ] && [ -x "$PG_BIN/pg_ctl" ]%postgresql
mariadbd and mariadb-install-db%[ -n "$MARIADBD" ] && [ -n "$INSTALL_DB" ]%mariadb-server-core
rabbitmq-server%[ -x "$RABBITMQ" ]%rabbitmq-server
the MariaDB client headers (mysqlclient builds against them)%has mariadb_config || has mysql_config%libmariadb-dev
pkg-config%has pkg-config%pkg-config
a C compiler%has cc%gcc libc6-dev
libfaketime%ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1%faketime
chromium%has chromium%chromium fonts-dejavu-core
chromedriver%has chromedriver%chromium-driver
pgbouncer%has pgbouncer%pgbouncer
openssl%has openssl%openssl
pgrep%has pgrep%procps
runuser (servers refuse root: run as their users)%! is_root || has runuser%util-linux
EOF
}
# missing: the packages of what is missing, one a line; its names to stderr with $1=say
missing() {
  local name test packages
  while IFS='%' read -r name test packages; do
    if ! eval "$test"; then
      [ "${1:-}" != say ] || say "  missing: $name (Debian package: $packages)"
      printf '%s\n' $packages
    fi
  done < <(needs)
}

install() {
  local packages
  mapfile -t packages < <(missing say)
  if [ ${#packages[@]} = 0 ]; then say "services.sh: nothing to install"; return 0; fi
  local sudo=()
  if ! is_root; then
    command -v sudo >/dev/null || die "installing needs root or sudo: apt-get install ${packages[*]}"
    sudo=(sudo)
  fi
  say "services.sh --install: apt-get install ${packages[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
  # Debian starts the servers it installs: the test command never uses them (its own run in its
  # folder), and leaves them be.
}

check() {
  local packages
  mapfile -t packages < <(missing say)
  [ ${#packages[@]} != 0 ] || return 0
  say "  install them with: bash tests/services.sh --install"
  say "  (that is: apt-get install ${packages[*]})"
  return 1
}

# -- starting and stopping one's own servers -----------------------------------------------------
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_open() { "$PY" -c 'import socket, sys; s = socket.socket(); s.settimeout(1); sys.exit(s.connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0)' "$1"; }
# as_user USER CMD...: the servers refuse to run as root; a user's run runs them as that user
as_user() { if is_root; then runuser -u "$1" -- "${@:2}"; else "${@:2}"; fi; }
# spawn LOG CMD...: in the background, in a session of its own (a Ctrl-C in the terminal goes to
# the test command, which stops the servers in order), its pid in $spawned
spawn() { local log=$1; shift; setsid "$@" </dev/null >"$log" 2>&1 & spawned=$!; }
# ready PID PORT SECONDS: PID (ours) is alive and PORT answers: the port is ours
ready() {
  local i
  for i in $(seq 1 $(($3 * 10))); do
    kill -0 "$1" 2>/dev/null || return 1
    if port_open "$2"; then return 0; fi
    sleep 0.1
  done
  return 1
}

# Each start_* runs in DIR/<service>/ and writes DIR/<service>.env (the exports) on success.
start_redis() {
  local home=$1/redis port
  mkdir -p "$home"
  for _ in 1 2 3; do  # a free port can be taken between the look-up and the start
    port=$(free_port)
    spawn "$home/redis.log" redis-server --bind 127.0.0.1 --port "$port" --save "" \
      --appendonly no --databases "${DRIFTSAFE_TEST_REDIS_DATABASES:-64}" --dir "$home" \
      --unixsocket "" --protected-mode yes
    echo "$spawned" > "$home/pid"
    if ready "$spawned" "$port" 10; then
      printf 'DRIFTSAFE_TEST_REDIS_URL=redis://127.0.0.1:%s\n' "$port" > "$1/redis.env"
      # the URL of a Redis the run started: tests/settings.py's REDIS_IS_PRIVATE (flushing allowed)
      printf 'DRIFTSAFE_TEST_REDIS_PRIVATE=redis://127.0.0.1:%s\n' "$port" >> "$1/redis.env"
      return 0
    fi
    kill "$spawned" 2>/dev/null || true
  done
  cat "$home/redis.log" >&2; return 1
}

start_postgres() {
  local home=$1/postgres port
  mkdir -p "$home"
  if is_root; then chown postgres "$home"; fi
  as_user postgres "$PG_BIN/initdb" -D "$home/data" -A trust -U postgres --no-sync -E UTF8 \
    >"$home/initdb.log" 2>&1 || { cat "$home/initdb.log" >&2; return 1; }
  for _ in 1 2 3; do
    port=$(free_port)
    # the chaos test restarts it: pg_ctl -D DATA -l DATA.log restart (tests/e2e/test_chaos.py)
    if as_user postgres "$PG_BIN/pg_ctl" -D "$home/data" -l "$home/data.log" -w -t 60 \
        -o "-p $port -k $home -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start >>"$home/initdb.log" 2>&1; then
      { printf 'DRIFTSAFE_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:%s\n' "$port"
        # the cluster's data directory: the chaos test restarts the cluster with pg_ctl
        printf 'DRIFTSAFE_TEST_PG_DATA=%s\n' "$home/data"; } > "$1/postgres.env"
      return 0
    fi
  done
  cat "$home/initdb.log" "$home/data.log" >&2; return 1
}

start_mariadb() {
  local home=$1/mariadb port user=()
  mkdir -p "$home"
  if is_root; then chown mysql "$home"; user=(--user=mysql); fi
  # --no-defaults: nothing of the machine's my.cnf (its datadir, its socket)
  "$INSTALL_DB" --no-defaults "${user[@]}" --datadir="$home/data" --auth-root-authentication-method=normal \
    --skip-test-db --skip-name-resolve >"$home/install.log" 2>&1 \
    || { cat "$home/install.log" >&2; return 1; }
  for _ in 1 2 3; do
    port=$(free_port)
    spawn "$home/mariadb.log" "$MARIADBD" --no-defaults "${user[@]}" --datadir="$home/data" \
      --port="$port" --bind-address=127.0.0.1 --socket="$home/mariadb.sock" \
      --pid-file="$home/mariadb.pid" --skip-grant-tables --skip-name-resolve --skip-log-bin \
      --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-buffer-pool-size=128M \
      --character-set-server=utf8mb4 --collation-server=utf8mb4_unicode_ci
    echo "$spawned" > "$home/pid"
    if ready "$spawned" "$port" 60; then
      printf 'DRIFTSAFE_TEST_MARIADB_URL=mysql://root@127.0.0.1:%s\n' "$port" > "$1/mariadb.env"
      return 0
    fi
    kill "$spawned" 2>/dev/null || true
    wait "$spawned" 2>/dev/null || true
  done
  cat "$home/mariadb.log" >&2; return 1
}

start_rabbitmq() {
  local home=$1/rabbitmq port epmd dist node
  mkdir -p "$home/mnesia" "$home/log"
  printf '[].\n' > "$home/enabled_plugins"   # no plugins: no management listener
  : > "$home/rabbitmq.conf"
  : > "$home/rabbitmq-env.conf"              # not /etc/rabbitmq's
  printf '[].\n' > "$home/advanced.config"
  "$PY" -c 'import secrets; print(secrets.token_hex(16))' > "$home/.erlang.cookie"
  chmod 400 "$home/.erlang.cookie"
  node="driftsafe-test-$$-$RANDOM"
  if is_root; then chown -R rabbitmq "$home"; fi
  for _ in 1 2 3; do
    port=$(free_port); epmd=$(free_port); dist=$(free_port)
    # an epmd of its own (ERL_EPMD_PORT), not the machine's; on loopback
    spawn "$home/rabbitmq.log" env HOME="$home" ERL_EPMD_PORT="$epmd" ERL_EPMD_ADDRESS=127.0.0.1 \
      RABBITMQ_NODENAME="$node@localhost" RABBITMQ_USE_LONGNAME=false \
      RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT="$dist" \
      RABBITMQ_CONF_ENV_FILE="$home/rabbitmq-env.conf" RABBITMQ_CONFIG_FILE="$home/rabbitmq.conf" \
      RABBITMQ_ADVANCED_CONFIG_FILE="$home/advanced.config" \
      RABBITMQ_ENABLED_PLUGINS_FILE="$home/enabled_plugins" RABBITMQ_MNESIA_BASE="$home/mnesia" \
      RABBITMQ_LOG_BASE="$home/log" RABBITMQ_PID_FILE="$home/rabbitmq.pid" \
      RABBITMQ_MOTD_FILE="$home/motd" \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none -kernel inet_dist_use_interface {127,0,0,1}" \
      "$(if is_root; then echo runuser; else echo env; fi)" \
      $(if is_root; then echo "-u rabbitmq --"; fi) "$RABBITMQ"
    echo "$spawned" > "$home/pid"
    echo "$epmd" > "$home/epmd-port"
    if ready "$spawned" "$port" 90; then
      printf 'DRIFTSAFE_TEST_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:%s//\n' "$port" \
        > "$1/rabbitmq.env"
      return 0
    fi
    stop_rabbitmq "$1"
  done
  cat "$home/rabbitmq.log" "$home"/log/*.log >&2 2>/dev/null; return 1
}

# stop_group PID: a spawned server and its children (its session), then wait for it
stop_group() {
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}
stop_redis() { [ ! -f "$1/redis/pid" ] || stop_group "$(cat "$1/redis/pid")"; }
stop_mariadb() { [ ! -f "$1/mariadb/pid" ] || stop_group "$(cat "$1/mariadb/pid")"; }
stop_postgres() {
  [ -f "$1/postgres/data/postmaster.pid" ] || return 0
  as_user postgres "$PG_BIN/pg_ctl" -D "$1/postgres/data" -m immediate -w stop >/dev/null 2>&1 || true
}
stop_rabbitmq() {
  local home=$1/rabbitmq
  [ ! -f "$home/pid" ] || stop_group "$(cat "$home/pid")"
  # its epmd daemonized (a session of its own): ask it to go, on its port
  [ ! -f "$home/epmd-port" ] || ERL_EPMD_PORT=$(cat "$home/epmd-port") epmd -kill >/dev/null 2>&1 || true
}

SERVICES=(redis postgres mariadb rabbitmq)
url_var() {
  case $1 in
    redis) echo DRIFTSAFE_TEST_REDIS_URL ;; postgres) echo DRIFTSAFE_TEST_POSTGRES_URL ;;
    mariadb) echo DRIFTSAFE_TEST_MARIADB_URL ;; rabbitmq) echo DRIFTSAFE_TEST_RABBITMQ_URL ;;
    *) die "no service $1: ${SERVICES[*]}" ;;
  esac
}

down() {
  local dir=$1 service
  [ -d "$dir" ] || return 0
  [ -f "$dir/.driftsafe-services" ] || die "$dir was not made by tests/services.sh up: left alone"
  for service in "${SERVICES[@]}"; do "stop_$service" "$dir"; done
  rm -rf "$dir"
}

up() {
  local dir=$1 service code=0 pids=() wanted=()
  shift
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  touch "$dir/.driftsafe-services"
  # PostgreSQL, MariaDB and RabbitMQ run as their users when this runs as root: they pass
  # through (the folders above it must let them too: tests/run.sh's scratch folder does)
  if is_root; then chmod 711 "$dir"; fi
  if [ $# -gt 0 ]; then
    wanted=("$@")
  else
    for service in "${SERVICES[@]}"; do
      local var; var=$(url_var "$service")
      [ -n "${!var:-}" ] || wanted+=("$service")
    done
  fi
  local packages
  mapfile -t packages < <(MISSING_ONLY="${wanted[*]}" missing_services)
  [ ${#packages[@]} = 0 ] \
    || die "not installed: ${packages[*]}: bash tests/services.sh --install (apt-get install ${packages[*]})"
  # side by side: RabbitMQ takes seconds, MariaDB's first start a few
  for service in "${wanted[@]}"; do
    url_var "$service" >/dev/null
    ( "start_$service" "$dir" ) >"$dir/$service.start.log" 2>&1 &
    pids+=($!)
  done
  local i
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      code=1
      say "could not start ${wanted[$i]} in $dir:"; cat "$dir/${wanted[$i]}.start.log" >&2
    fi
  done
  if [ "$code" != 0 ]; then down "$dir"; exit 1; fi
  exports "$dir"
}
# the packages of the wanted services' missing servers
missing_services() {
  local service
  for service in $MISSING_ONLY; do
    case $service in
      redis) has redis-server || echo redis-server ;;
      postgres) [ -x "$PG_BIN/initdb" ] || echo postgresql ;;
      mariadb) [ -n "$MARIADBD" ] && [ -n "$INSTALL_DB" ] || echo mariadb-server-core ;;
      rabbitmq) [ -x "$RABBITMQ" ] || echo rabbitmq-server ;;
    esac
  done
}

# The exports for pytest: the servers started in DIR, and the URLs given for the others.
exports() {
  local dir=$1 service var
  echo "export DRIFTSAFE_TEST_SERVICES=$dir"
  echo "export DRIFTSAFE_TEST_RUN_ID=${DRIFTSAFE_TEST_RUN_ID:-$("$PY" -c 'import secrets; print(secrets.token_hex(4))')}"
  for service in "${SERVICES[@]}"; do
    if [ -f "$dir/$service.env" ]; then
      sed 's/^/export /' "$dir/$service.env"
    else
      var=$(url_var "$service")
      [ -z "${!var:-}" ] || printf 'export %s=%q\n' "$var" "${!var}"
    fi
  done | tee "$dir/exports"
}

case ${1:-} in
  --install) install ;;
  check) check ;;
  up)
    if [ $# -ge 2 ]; then up "${@:2}"
    else up "$(mktemp -d "${TMPDIR:-/tmp}/driftsafe-services.XXXXXX")"; fi
    [ $# -ge 2 ] || say "services.sh: started; stop them with: bash tests/services.sh down"
    ;;
  down)
    dir=${2:-${DRIFTSAFE_TEST_SERVICES:-}}
    [ -n "$dir" ] || die "down: which folder? (DRIFTSAFE_TEST_SERVICES is not set)"
    down "$dir"
    ;;
  *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
