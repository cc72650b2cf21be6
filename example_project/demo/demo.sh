#!/usr/bin/env bash
# The README's first command: bash example_project/demo/demo.sh
#
# Builds a fresh virtual environment (.venv-demo at the repository root; DEMO_REUSE_VENV=1
# keeps an existing one), installs celery_driftsafe with the results, postgres and demo
# extras, then runs `python -m demo` in example_project/: its own Redis, SQLite, three beats with skewed
# clocks and a worker for DEMO_SECONDS (default 60), then a table, a picture and the verdict.
# Exit status: 0 when every due slot ran exactly once and none early, 1 when not, 2 when the
# demo could not run. `bash example_project/demo/admin.sh` then opens the admin on the same data.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=${DEMO_VENV:-$ROOT/.venv-demo}

if ! command -v "$PYTHON" >/dev/null; then
  echo "No $PYTHON on PATH: install Python 3.11 or later, or set PYTHON=/path/to/python3." >&2
  exit 2
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "celery_driftsafe needs Python 3.11 or later; $PYTHON is $("$PYTHON" -V 2>&1)." \
       "Set PYTHON=python3.12 (for example)." >&2
  exit 2
}
if [ "${DEMO_REUSE_VENV:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; then
  echo "== virtual environment $VENV (fresh)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" || {
    echo "Could not create a virtual environment. On Debian or Ubuntu: apt-get install python3-venv" >&2
    exit 2
  }
fi
echo "== installing celery_driftsafe[results,postgres,admin] (editable) and matplotlib"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e "$ROOT[results,postgres,admin]" \
  --group "$ROOT/pyproject.toml:demo"
echo
cd "$ROOT/example_project"
exec "$VENV/bin/python" -m demo "$@"
