"""Layer 2, jaxpr: marks on traced values, jaxpr walking, per-primitive iteration-space rules, the operator graph
built from a jaxpr, calls under the user's own trace, and where user splits meet."""
