"""Importing mshard starts no XLA backend: a multi-process job imports it before jax.distributed.initialize,
which refuses to run once a backend exists (found when an import-time jnp.zeros broke every `mshard run` job)."""

import subprocess
import sys

CODE = """
import mshard, mshard.nn, mshard.ops, mshard.parallel
from jax._src import xla_bridge
print(sorted(xla_bridge._backends))
"""


def test_importing_mshard_initialises_no_backend():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
