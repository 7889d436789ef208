"""What a train step costs and how fast it runs: model FLOPs, peak FLOP/s, tokens/s, MFU.

MFU (model FLOPs utilisation) = the model's matmul FLOPs per second / the devices' peak
dense bf16 FLOP/s. The FLOPs are counted from the model's shapes (`train_step_flops`), not
from what XLA runs, so recomputation (remat) does not count and runs compare by work done.
"""

import time
from typing import TYPE_CHECKING

import jax

from lambjax.models.config import BertConfig

if TYPE_CHECKING:  # the plan imports the config's ml_collections, which FLOP counts do not need
    from lambjax.train.plan import PhasePlan, RunPlan

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


def forward_flops(
    config: BertConfig, batch_size: int, seq_len: int, predictions: int, *, num_layers=None
) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward pass, MLM head on gathered positions.

    Per sequence and layer: Q, K, V and output projections 4 * 2*S*H^2; attention scores and
    their product with V 2 * 2*S^2*H (bidirectional: every query sees every key); the MLP
    2 * 2*S*H*I. Heads: pooler 2*H^2, NSP 2*H*2, and per masked position the transform
    2*H^2 plus the tied decoder 2*H*V. `num_layers` counts only that many encoder layers.
    """
    h, m, s, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size
    layers = config.num_layers if num_layers is None else num_layers
    per_layer = 8 * s * h * h + 4 * s * s * h + 4 * s * h * m
    heads = 2 * h * h + 4 * h + predictions * (2 * h * h + 2 * h * v)
    return batch_size * (layers * per_layer + heads)


def train_step_flops(
    config: BertConfig,
    batch_size: int,
    seq_len: int,
    max_predictions_per_seq: int,
    *,
    num_frozen_layers: int = 0,
) -> int:
    """Forward + backward (twice the forward: gradients of activations and of weights).

    Frozen bottom layers (a stage of multi-stage layerwise training) run forward only.
    """
    args = (config, batch_size, seq_len, max_predictions_per_seq)
    frozen = forward_flops(*args, num_layers=num_frozen_layers) - forward_flops(*args, num_layers=0)
    return 3 * forward_flops(*args) - 2 * frozen


class Throughput:
    """Step time, tokens/s and MFU over the steps since the last measurement."""

    def __init__(self, *, tokens_per_step: int, flops_per_step: int, peak_flops: float | None):
        self._tokens_per_step = tokens_per_step
        self._flops_per_step = flops_per_step
        self._peak_flops = peak_flops  # of all devices together; None: unknown (no MFU)
        self._start_step = None
        self._start_time = None

    def reset(self, step: int) -> None:
        self._start_step, self._start_time = step, time.perf_counter()

    def measure(self, step: int) -> dict:
        """The first call only starts the clock (its window holds the compilation)."""
        now = time.perf_counter()
        if self._start_step is None or step <= self._start_step:
            self.reset(step)
            return {}
        seconds = (now - self._start_time) / (step - self._start_step)
        self.reset(step)
        out = {
            "step_time_s": seconds,
            "tokens_per_s": self._tokens_per_step / seconds,
            "flops_per_s": self._flops_per_step / seconds,
        }
        if self._peak_flops:
            out["mfu"] = self._flops_per_step / seconds / self._peak_flops
        return out


def phase_step_flops(plan: "PhasePlan") -> int:
    """Model FLOPs of one optimizer step of the phase `plan`."""
    return train_step_flops(
        plan.model,
        plan.batch.global_batch_size,
        plan.batch.max_seq_length,
        plan.batch.max_predictions_per_seq,
        num_frozen_layers=plan.step.num_frozen_layers,
    )


def later_phases_flops(run_plan: "RunPlan", plan: "PhasePlan") -> int:
    """Model FLOPs of every step of the phases after `plan` (for the run's ETA)."""
    return sum(p.num_steps * phase_step_flops(p) for p in run_plan.phases[plan.index + 1 :])


def phase_meter(run_plan: "RunPlan", plan: "PhasePlan") -> Throughput:
    """The throughput meter of the phase `plan` over all of this run's devices."""
    peak = peak_flops_per_device(run_plan.peak_flops_per_device)
    return Throughput(
        tokens_per_step=plan.batch.global_batch_size * plan.batch.max_seq_length,
        flops_per_step=phase_step_flops(plan),
        peak_flops=peak * jax.device_count() if peak else None,
    )
