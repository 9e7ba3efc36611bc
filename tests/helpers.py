"""Helpers the test files share (importable as ``helpers``: pytest puts tests/ on sys.path)."""

import jax

from jax_moe.config import MoEConfig


def jit_call(fn, *args, **kw):
    """``fn(*args, **kw)`` under jax.jit with every array (and QuantConfig) an argument; strings,
    numbers and MoEConfigs stay static. On CPU an eager call runs op by op and arrays closed over by
    the jitted function are constant-folded: both cost seconds per call."""
    static = {k: v for k, v in kw.items() if v is None or isinstance(v, (str, bool, int, float, MoEConfig))}
    arrays = {k: v for k, v in kw.items() if k not in static}
    return jax.jit(lambda a, d: fn(*a, **d, **static))(args, arrays)
