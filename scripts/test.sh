#!/usr/bin/env bash
# Set everything up and run the whole test suite (8 simulated CPU devices, set in tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
