#!/usr/bin/env bash
# Set everything up and run the quickstart on 8 simulated CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu .venv/bin/python examples/quickstart.py
