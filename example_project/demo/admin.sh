#!/usr/bin/env bash
# The Django admin on the demo's data: bash example_project/demo/admin.sh (after demo.sh).
#
# Uses .venv-demo, starts a Redis as the demo does (or uses EXAMPLE_REDIS_URL), migrates,
# makes sure a superuser exists -- DJANGO_SUPERUSER_USERNAME / DJANGO_SUPERUSER_PASSWORD,
# default admin / driftsafe-demo, printed -- and serves http://127.0.0.1:8000/admin/
# (EXAMPLE_ADMIN_PORT to change the port) until Ctrl-C.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${DEMO_VENV:-$ROOT/.venv-demo}
if [ ! -x "$VENV/bin/python" ]; then
  echo "No $VENV yet: run bash example_project/demo/demo.sh first (it builds it, and the data)." >&2
  exit 2
fi
cd "$ROOT/example_project"
exec "$VENV/bin/python" -m demo admin "$@"
