#!/usr/bin/env bash
# Create/refresh the local virtual environment .venv with mshard (editable) and its test extras.
# Quiet unless something fails: pip's output goes to .venv/setup.log and is shown only on an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/setup.log
if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e '.[test]'; } \
        >"$log" 2>&1; then
    cat "$log" >&2
    echo "scripts/setup.sh: installing mshard into .venv failed (log above, also in $log)" >&2
    exit 1
fi
echo "scripts/setup.sh: .venv ready ($(.venv/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)'))"
