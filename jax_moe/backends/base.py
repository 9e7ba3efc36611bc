"""The backend interface: what a module under ``jax_moe/backends/`` provides to be a row of the
oracle (:data:`jax_moe.oracle.MODULES`).

A backend is a module; its module-level names satisfy these protocols (the methods below are its
functions, without ``self``), and ``isinstance(module, Backend)`` holds. Shapes: T tokens, k
routed experts a token, E experts, H the hidden size, I the intermediate size (``N1 = 2I`` for a
gated activation, ``I`` for ``relu2``), C rows of capacity per expert on the batched format.
Weights are in vLLM's orientation (``docs/ARCHITECTURE.md``): ``w13 [E, N1, H]``, ``w2 [E, H, I]``,
K the last axis; quantized weights as their :class:`jax_moe.QuantConfig` stores them.

* :class:`Backend`: every backend. ``NAME``, ``FEATURES``, ``supports``, ``apply``.
* :class:`PreparedBackend`: a backend with a weight layout of its own, repacked once at load time
  (``MoEBlock.prepare()``, the oracle's ``prepared=True``).
* :class:`DifferentiableBackend`: a backend of custom calls with a backward of its own (the
  feature ``"grad"``; :mod:`jax_moe.autodiff` runs it under ``jax.grad``).
* :class:`BatchedBackend`: a backend with the expert stage on the batched format (the feature
  ``"batched"``, what :mod:`jax_moe.parallel` runs between dispatch and combine).
* :class:`ShardedPreparedBackend`: prepared weights that :mod:`jax_moe.parallel` places over a
  mesh (``shard_prepared``, ``parallel_apply_prepared``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# what FEATURES may list: the call's needs beyond its MoEConfig and QuantConfig (jax_moe.oracle.call_features)
FEATURE_NAMES = ("bias", "router_weight_on_input", "batched", "grad")  # and "dtype:<numpy name>" entries


@runtime_checkable
class Backend(Protocol):
    """One kernel family behind ``fused_experts(..., backend=NAME)``.

    ``NAME``: the oracle's name of the backend (a key of :data:`jax_moe.oracle.MODULES`).

    ``FEATURES``: what :func:`apply` takes beyond the configs: ``"bias"`` (``w13_bias [E, N1]``,
    ``w2_bias [E, H]``), ``"router_weight_on_input"`` (top-1: the weight scales x, not the
    output), ``"batched"`` (:class:`BatchedBackend`), ``"grad"`` (a differentiated call may run
    it: JAX differentiates its ``apply``, or it is a :class:`DifferentiableBackend`), and
    ``"dtype:<name>"`` entries naming the
    unquantized weights' dtypes it takes (none listed: any). The oracle refuses a call needing a
    feature the backend does not list, with the reason, before asking :func:`supports`'s answer
    to count; a backend listing ``dtype:`` entries is also told the call's dtype in
    :func:`supports`.
    """

    NAME: str
    FEATURES: frozenset[str]

    def supports(self, cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
        """``(True, what serves it)`` or ``(False, why not)`` for a layer ``cfg``
        (:class:`jax_moe.config.MoEConfig`) with ``quant`` (None: unquantized; else a
        :class:`jax_moe.QuantConfig`) on ``device`` (a jax Device, a
        :class:`jax_moe.device.DeviceInfo`, or None: JAX's default device). ``dtype``: the
        unquantized weights' dtype (a numpy dtype name or dtype; None: not known), for a backend
        whose scheme depends on it. The hardware first, then what this build has, then the
        shapes; never raises for a config it cannot serve."""
        ...

    def apply(self, x, w13, w2, topk_weights, topk_ids, cfg, **options) -> Any:
        """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``.

        x [T, H] float; w13 [E, N1, H] and w2 [E, H, I] (x's dtype, or as ``quant`` stores them);
        topk_weights [T, k] float; topk_ids [T, k] int32 in [0, E), or outside it (-1: an expert
        on another device) for a slot that contributes nothing; ``cfg`` the layer's MoEConfig.
        ``options``: ``quant``, ``w13_bias``, ``w2_bias``, ``apply_router_weight_on_input`` (as
        ``FEATURES`` says) and the backend's own. Returns [T, H] in x's dtype. ``fused_experts``
        checks the shapes and dtypes first; a backend raises ValueError for what it does not
        take."""
        ...


@runtime_checkable
class PreparedBackend(Backend, Protocol):
    """A backend with its own weight layout: :func:`prepare` once, :func:`apply_prepared` per call."""

    def prepare(self, w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None) -> Any:
        """The weights as ``apply`` takes them (biases ``w13_bias [E, N1]``, ``w2_bias [E, H]`` in
        vLLM's row order, where ``FEATURES`` has ``"bias"``) -> the backend's prepared weights, a
        pytree (jit-able). ValueError for what the backend does not serve."""
        ...

    def apply_prepared(self, x, prepared, topk_weights, topk_ids, **options) -> Any:
        """:meth:`Backend.apply` on weights from :func:`prepare`: x [T, H], topk_weights [T, k],
        topk_ids [T, k] int32 -> [T, H] (the backend's output dtype: the caller casts)."""
        ...


@runtime_checkable
class DifferentiableBackend(Backend, Protocol):
    """A backend of custom calls that trains (``"grad"`` in ``FEATURES``): its forward keeps
    residuals, its backward turns them and the cotangent into gradients."""

    def vjp_fwd(self, x, w13, w2, topk_weights, topk_ids, cfg, **options) -> tuple[Any, Any]:
        """:meth:`Backend.apply` on float weights -> (out [T, H], residuals: a pytree of arrays).
        ``options`` as ``apply``'s, plus ``residuals`` (``"save"``: keep the intermediates the
        backward needs; ``"recompute"``: keep only the inputs)."""
        ...

    def vjp_bwd(self, res, g, cfg, **options) -> tuple:
        """The cotangent g [T, H] at ``res`` -> (dx [T, H], dw13 [E, N1, H], dw2 [E, H, I],
        dtopk_weights [T, k], dw13_bias, dw2_bias), each in its input's dtype (None for an absent
        bias). ``options`` as :meth:`vjp_fwd`'s."""
        ...


@runtime_checkable
class BatchedBackend(Backend, Protocol):
    """A backend with the expert stage on the batched format (``"batched"`` in ``FEATURES``)."""

    def apply_batched(self, x, counts, w13, w2, cfg, **options) -> Any:
        """``y[e, r] = expert_e(x[e, r])`` for ``r < counts[e]``: x [E, C, H] (rows at or past
        ``counts[e]`` are padding, never read), counts [E] int32, the weights as ``apply`` takes
        them. No routing weights (the combine applies them). Returns [E, C, H] in x's dtype, rows
        at or past ``counts[e]`` zero."""
        ...


@runtime_checkable
class ShardedPreparedBackend(PreparedBackend, Protocol):
    """Prepared weights that :mod:`jax_moe.parallel` splits over experts (and the intermediate size)."""

    def alignment(self, quant=None) -> int:
        """H and I must be multiples of this for ``quant``'s scheme (each device's I slice too)."""
        ...

    def partition_specs(self, prepared, ep_axis, num_experts: int, tp_axis=None) -> Any:
        """The prepared pytree with a ``PartitionSpec`` per array: expert axes over ``ep_axis``,
        intermediate-size axes over ``tp_axis``, the rest replicated."""
        ...
