"""Oracle rows for vLLM's backend families that jax_moe does not run yet, each with the reason it
gives on every device: the hardware it needs first, then what is missing in this build.
(``flashinfer_trtllm`` has its own module now: :mod:`jax_moe.backends.flashinfer_trtllm`.)

| backend              | hardware              | schemes                          | status here                     |
| -------------------- | --------------------- | -------------------------------- | ------------------------------- |
| marlin               | SM80+ (weight-only)   | nvfp4/mxfp4/w4a8 weights, bf16 x | not provided: on SM90 flashinfer_cutlass's mixed-input W4A16 path serves weight-only MXFP4 |
"""

from __future__ import annotations

from jax_moe.device import device_info

# backend -> (SM numbers it runs on, schemes it serves, what this build lacks)
ROWS: dict[str, tuple[tuple[int, ...], tuple[str, ...], str]] = {
    "marlin": ((80, 86, 89, 90), ("nvfp4", "mxfp4", "w4a8"),
               "not provided: on SM90, weight-only MXFP4 (W4A16) is served by flashinfer_cutlass's "
               "mixed-input GEMMs instead (QuantConfig(scheme='mxfp4', act='bf16')); Marlin's other "
               "weight-only 4-bit paths (SM80/SM89, NVFP4) are not built"),
}


def refusal(name: str, cfg, quant, device) -> tuple[bool, str]:
    """Why ``name`` cannot serve (cfg, quant) on ``device``: hardware first, then this build."""
    sms, schemes, missing = ROWS[name]
    dev = device_info(device)
    scheme = "bf16" if quant is None else quant.scheme
    if dev.sm not in sms:
        need = "/".join(f"SM{s}" for s in sms)
        return False, f"needs {need}; this device is {dev.describe()}"
    if scheme not in schemes:
        return False, f"does not serve scheme {scheme!r} (serves {', '.join(schemes)})"
    return False, missing
