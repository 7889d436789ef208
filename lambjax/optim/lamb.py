"""LAMB as an optax chain of small transforms."""

import optax

from lambjax.optim import transforms
from lambjax.optim.hyperparameters import check_hyperparameters, is_python_zero
from lambjax.optim.per_tensor import MaskOrFn, checked_mask


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: MaskOrFn = None,
    trust_ratio_mask: MaskOrFn = None,
    max_global_norm: float | None = None,
    bias_correction: bool = True,
    stacked_layers: MaskOrFn = None,
    param_norm_bounds: tuple[float, float] | None = None,
) -> optax.GradientTransformation:
    """LAMB: Adam moments, decoupled weight decay, a layer-wise trust ratio.

    With the defaults this is the paper's algorithm (what `optax.lamb(mask=...)` computes,
    but with per-layer ratios for stacked leaves). NVIDIA's BERT recipe is
    `weight_decay=0.01, weight_decay_mask=m, trust_ratio_mask=m, max_global_norm=1.0` with
    `m = lambjax.optim.bert_weight_decay_mask`.

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, eps: Adam's; eps is added outside the square root.
      weight_decay: decoupled decay rate λ (added to the Adam direction before the ratio);
        a float or an optax schedule.
      weight_decay_mask: which leaves are decayed (optax mask convention; None = all).
      trust_ratio_mask: which leaves get a trust ratio (None = all; False leaves use 1).
      max_global_norm: clip the gradient's global norm to this first (None = no clip).
      bias_correction: Adam's bias correction of the moments.
      stacked_layers: which leaves stack layers on axis 0 (one ratio per layer slice).
      param_norm_bounds: optional (lower, upper) clip of ||x|| in the ratio (phi).

    References:
      You et al., 2020: https://arxiv.org/abs/1904.00962
    """
    check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_global_norm)
    if weight_decay_mask is not None:
        weight_decay_mask = checked_mask(weight_decay_mask, "weight_decay_mask")
    return optax.chain(
        transforms.optional_clip_by_global_norm(max_global_norm),
        transforms.scale_by_adam(b1, b2, eps, bias_correction=bias_correction),
        optax.identity()
        if is_python_zero(weight_decay)
        else optax.add_decayed_weights(weight_decay, weight_decay_mask),
        transforms.scale_by_trust_ratio(
            mask=trust_ratio_mask,
            stacked_layers=stacked_layers,
            param_norm_bounds=param_norm_bounds,
        ),
        transforms.scale_by_learning_rate(learning_rate),
    )
