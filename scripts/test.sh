#!/usr/bin/env bash
# Set everything up and run the whole test suite (8 simulated CPU devices, set in tests/conftest.py).
# With no arguments (CI, the README's command) the test files are split over MSHARD_TEST_PROCS pytest processes
# (default: the cores, at most 2) that run at once, each printing its report when done; with arguments (a file,
# -m "not slow", -k ...) one pytest runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
procs=${MSHARD_TEST_PROCS:-$(python3 -c 'import os; print(min(2, os.cpu_count() or 1))')}
if [ $# -gt 0 ] || [ "$procs" -le 1 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for k in $(seq 0 $((procs - 1))); do
    MSHARD_TEST_SHARD="$k/$procs" .venv/bin/python -m pytest -q -p no:cacheprovider >"$logs/$k.log" 2>&1 &
    pids+=($!)
done
status=0
for k in $(seq 0 $((procs - 1))); do
    rc=0
    wait "${pids[$k]}" || rc=$?
    echo "=== pytest shard $k/$procs (exit $rc) ==="
    cat "$logs/$k.log"
    [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
