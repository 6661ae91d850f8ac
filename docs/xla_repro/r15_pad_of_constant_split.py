# Plain JAX, no mshard: a pad with interior padding (the transpose of a stride-2 slice) of a replicated constant,
# constrained split 8 ways on the padded dim, fails XLA's HLO verifier under jax.jit on 8 CPU devices (JAX 0.10):
# "Expected instruction to have shape equal to f32[16,1], actual shape is f32[16,2]". Constraining the pad whole
# first, then split, compiles. Found by the differential fuzzer (seed 320993: a searched gradient of
# Sigmoid -> Minimum -> Transpose -> StridedSlice).
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
def f(x):
    g = jax.lax.with_sharding_constraint(jnp.ones((16, 8), jnp.float32), NamedSharding(mesh, P()))
    p = jax.lax.pad(g, 0.0, [(0, 0, 0), (0, 1, 1)])
    p = jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P(None, ("a", "b", "c"))))
    return p.T * x
print(jax.jit(f)(jnp.ones((16, 16), jnp.float32)))      # JaxRuntimeError INTERNAL: hlo verifier
