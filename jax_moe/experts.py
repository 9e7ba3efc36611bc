"""The public entry points: ``fused_experts`` (routed tokens -> output) and ``fused_moe``
(router logits -> output). Both check every argument before anything is traced, ask the
oracle for a backend, and call it."""

from __future__ import annotations

import jax
import numpy as np

from jax_moe import oracle
from jax_moe.autodiff import differentiable
from jax_moe.config import ACTIVATIONS, FLOAT_DTYPES, MoEConfig, as_jax, check_dtype, check_rank, check_shape
from jax_moe.routing import select_experts


def moe_config_from_arrays(
    x, w13, w2, topk_ids, *, activation: str, gate_up_layout: str, quant, swiglu_alpha: float, swiglu_limit: float
) -> MoEConfig:
    """Check the shapes and dtypes of the data arguments and derive the layer's :class:`MoEConfig`."""
    check_rank("x", x, 2, "[T, H]")
    check_rank("w13", w13, 3, "[E, 2I, H]")
    check_rank("w2", w2, 3, "[E, H, I]")
    check_rank("topk_ids", topk_ids, 2, "[T, k]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("topk_ids", topk_ids, ("int32",))
    t, h = x.shape
    e = w13.shape[0]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    gated = ACTIVATIONS[activation]
    rows = w13.shape[1]
    if gated and rows % 2:
        raise ValueError(f"w13 must have an even number of rows (gate and up halves, 2I), got {rows}")
    inter = rows // 2 if gated else rows
    k = topk_ids.shape[1]
    cfg = MoEConfig(e, k, h, inter, activation, gate_up_layout, swiglu_alpha, swiglu_limit)
    check_shape("topk_ids", topk_ids, (t, None), "[T, k] with T = x.shape[0]")
    if quant is None:
        check_dtype("w13", w13, FLOAT_DTYPES)
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(
                f"w13 and w2 must have x's dtype {np.dtype(x.dtype).name} (or pass quant=), "
                f"got {np.dtype(w13.dtype).name} and {np.dtype(w2.dtype).name}"
            )
        check_shape("w13", w13, (e, cfg.w13_rows, h), "[E, 2I, H] with H = x.shape[1]")
        check_shape("w2", w2, (e, h, inter), "[E, H, I] with I from w13")
    else:
        if w2.shape[0] != e:
            raise ValueError(f"w2 must have w13's E={e} experts [E, H, ...], got shape {list(w2.shape)}")
        if w2.shape[1] != h:
            raise ValueError(f"x [T, H] and w2 [E, H, ...] must have the same H: x has H={h} (shape "
                             f"{list(x.shape)}), w2 has H={w2.shape[1]}")
        quant.validate(e, h, inter, gated, w13=w13, w2=w2)
    return cfg


def fused_experts(
    x: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: str = "silu",
    gate_up_layout: str = "concat",
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
    quant=None,
    backend: str | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    residuals: str = "save",
) -> jax.Array:
    """Run the routed experts and reduce over top-k.

    x [T, H] float; w13 [E, 2I, H] (gate rows then up rows; [E, I, H] for ``relu2``);
    w2 [E, H, I]; topk_weights [T, k] float; topk_ids [T, k] int32 in [0, E), or -1 (expert
    parallelism's mark for an expert another rank owns), whose slot contributes zero. The ids are
    traced values and are not validated.
    With ``quant`` (a :class:`jax_moe.QuantConfig`), w13/w2 are the stored quantized tensors.
    Returns [T, H] in x's dtype. Any array may be numpy or jax (committed or not).
    ``swiglu_alpha``/``swiglu_limit`` must be finite and > 0 (ValueError naming them).

    Under ``jax.grad`` the call runs on a backend that trains (the oracle's feature ``"grad"``:
    ``cutlass`` on its own backward kernels, ``xla``); a forced ``backend`` that does not train
    raises a ValueError when differentiated. ``residuals`` (``"save"`` or ``"recompute"``): what
    a kernel backend keeps from its forward for the backward (the permuted rows and GEMM
    outputs, or only the inputs, recomputing the rest).
    """
    if residuals not in ("save", "recompute"):
        raise ValueError(f"residuals must be 'save' or 'recompute', got {residuals!r}")
    x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, quant = as_jax(
        x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, quant)
    cfg = moe_config_from_arrays(
        x, w13, w2, topk_ids, activation=activation, gate_up_layout=gate_up_layout, quant=quant,
        swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
    )
    check_shape("topk_weights", topk_weights, topk_ids.shape, "[T, k], like topk_ids")
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    if w13_bias is not None:
        check_shape("w13_bias", w13_bias, (cfg.num_experts, cfg.w13_rows), "[E, 2I]")
    if w2_bias is not None:
        check_shape("w2_bias", w2_bias, (cfg.num_experts, cfg.hidden_size), "[E, H]")
    if apply_router_weight_on_input and cfg.top_k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k={cfg.top_k}")
    return run_experts(
        x, w13, w2, topk_weights, topk_ids, cfg, quant=quant, w13_bias=w13_bias, w2_bias=w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input, backend=backend, residuals=residuals,
    )


def run_experts(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, *, backend: str | None = None,
                device=None, **options):
    """The oracle's backend on already-checked arguments (``options`` as the backends' ``apply``),
    chosen for ``device`` (a jax Device; None: JAX's default device)."""
    quant = options.get("quant")
    residuals = options.pop("residuals", "save")
    features = oracle.call_features(dtype=w13.dtype if quant is None else None, **options)
    sel = oracle.select_backend(cfg, quant, backend=backend, device=device, features=features)
    if sel.name == "xla" or quant is not None:
        return sel.module.apply(x, w13, w2, topk_weights, topk_ids, cfg, **options)
    # a kernel backend on float weights: under jax.grad, the oracle's pick among the backends that train
    def trainer():
        return oracle.select_backend(cfg, None, backend=backend, device=device, features=features | {"grad"}).module

    b13, b2 = options.pop("w13_bias", None), options.pop("w2_bias", None)
    f = differentiable(sel.module, trainer, cfg, residuals=residuals, **options)
    return f(x, w13, w2, topk_weights, topk_ids, b13, b2)


def run_experts_batched(x, counts, w13, w2, cfg: MoEConfig, *, backend: str | None = None, device=None,
                        **options):
    """The expert stage on the batched format (x [E, C, H], counts [E] int32 -> y [E, C, H]; see
    ``xla.apply_batched``) with the oracle's backend for ``device`` among those that have one (feature
    ``"batched"``); a forced ``backend`` without one raises ValueError with that reason."""
    quant = options.get("quant")
    features = oracle.call_features(dtype=w13.dtype if quant is None else None, batched=True, **options)
    impl = oracle.select_backend(cfg, quant, backend=backend, device=device, features=features).module
    return impl.apply_batched(x, counts, w13, w2, cfg, **options)


def fused_moe(
    x: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    router_logits: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
    **expert_options,
) -> jax.Array:
    """Routing (:func:`jax_moe.select_experts`) then :func:`fused_experts`.

    router_logits [T, E]; ``top_k`` an int (numpy ints too, not a bool); ``routed_scaling_factor``
    finite and > 0; ``expert_options`` are fused_experts' keyword arguments. Arrays may be numpy.
    """
    x, w13, w2, router_logits, e_score_correction_bias = as_jax(x, w13, w2, router_logits, e_score_correction_bias)
    check_shape("router_logits", router_logits, (x.shape[0] if getattr(x, "ndim", 0) == 2 else None, None),
                "[T, E] with T = x.shape[0]")
    if w13.ndim >= 1 and router_logits.shape[1] != w13.shape[0]:
        raise ValueError(
            f"router_logits has {router_logits.shape[1]} experts but w13 has E={w13.shape[0]}"
        )
    weights, ids = select_experts(
        router_logits, top_k, scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
    return fused_experts(x, w13, w2, weights, ids, **expert_options)
