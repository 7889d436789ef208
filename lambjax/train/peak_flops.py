"""Peak FLOP/s of an accelerator, for MFU (model FLOPs utilisation)."""

import jax

# Peak dense bf16 FLOP/s of one JAX device, by `device_kind` prefix (vendor data sheets).
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v3": 61.5e12,  # one core; a v3 chip (2 cores) is 123 TFLOP/s
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
}


def peak_flops_per_device(configured: float) -> float | None:
    """The configured peak, else the data-sheet peak of this device kind, else None."""
    if configured:
        return float(configured)
    kind = jax.devices()[0].device_kind
    for prefix, flops in PEAK_FLOPS_BY_DEVICE_KIND.items():
        if kind.startswith(prefix):
            return flops
    return None
