"""LANS as an optax chain of small transforms."""

import optax

from lambjax.optim import transforms
from lambjax.optim.hyperparameters import check_hyperparameters
from lambjax.optim.per_tensor import MaskOrFn


def lans(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: MaskOrFn = None,
    max_global_norm: float | None = None,
    bias_correction: bool = True,
    stacked_layers: MaskOrFn = None,
    param_norm_bounds: tuple[float, float] | None = None,
) -> optax.GradientTransformation:
    """LANS: per-tensor normalised gradients, Adam moments, and a step that sums two
    trust-scaled directions (the Adam direction and the normalised-gradient direction).

    As the authors' reference: every tensor gets trust ratios; `weight_decay_mask` only
    switches decay off (BERT: biases and LayerNorm). `max_global_norm` clips before the
    normalisation, as the authors' scripts do (1.0); it then matters only through eps.

    References:
      Zheng et al., 2020: https://arxiv.org/abs/2006.13484
    """
    check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_global_norm)
    return optax.chain(
        transforms.optional_clip_by_global_norm(max_global_norm),
        transforms.normalize_per_tensor(stacked_layers),
        transforms.scale_by_lans(
            b1,
            b2,
            eps,
            weight_decay=weight_decay,
            weight_decay_mask=weight_decay_mask,
            stacked_layers=stacked_layers,
            param_norm_bounds=param_norm_bounds,
            bias_correction=bias_correction,
        ),
        transforms.scale_by_learning_rate(learning_rate),
    )
