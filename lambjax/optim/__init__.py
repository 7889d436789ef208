"""LAMB and LANS as composable optax transformations, with the recipes' schedules.

import optax
from lambjax import optim

tx = optim.lans(optim.warmup_constant_decay_schedule(5e-3, 10_000, 0.05, 0.25),
                weight_decay=0.01, weight_decay_mask=optim.bert_weight_decay_mask,
                stacked_layers=optim.stacked_layers_mask)

Under `optax.inject_hyperparams` every numeric argument becomes part of the state; masks
given as callables go in `static_args` (a callable argument is otherwise taken for a
schedule):

tx = optax.inject_hyperparams(optim.lans, static_args=("weight_decay_mask", "stacked_layers"))(
    5e-3, weight_decay=0.01, weight_decay_mask=optim.bert_weight_decay_mask,
    stacked_layers=optim.stacked_layers_mask)
"""

from lambjax.optim.lamb import lamb
from lambjax.optim.lans import lans
from lambjax.optim.masks import bert_weight_decay_mask, stacked_layers_mask
from lambjax.optim.schedules import (
    linear_warmup_decay_schedule,
    poly_warmup_schedule,
    warmup_constant_decay_schedule,
)
from lambjax.optim.stacking import on_stacked_layers
from lambjax.optim.state import last_norms, last_trust_ratios, per_tensor_tree, restart_step_count
from lambjax.optim.transforms import (
    LearningRateState,
    ScaleByLansState,
    TrustRatioState,
    clip_by_global_norm,
    normalize_per_tensor,
    scale_by_adam,
    scale_by_lans,
    scale_by_learning_rate,
    scale_by_trust_ratio,
)

__all__ = [
    "LearningRateState",
    "ScaleByLansState",
    "TrustRatioState",
    "bert_weight_decay_mask",
    "clip_by_global_norm",
    "lamb",
    "lans",
    "last_norms",
    "last_trust_ratios",
    "normalize_per_tensor",
    "on_stacked_layers",
    "per_tensor_tree",
    "linear_warmup_decay_schedule",
    "poly_warmup_schedule",
    "restart_step_count",
    "scale_by_learning_rate",
    "scale_by_adam",
    "scale_by_lans",
    "scale_by_trust_ratio",
    "stacked_layers_mask",
    "warmup_constant_decay_schedule",
]
