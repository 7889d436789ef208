"""Builds a phase's optimizer and learning-rate schedule from the config."""

import optax

from lambjax import optim


def learning_rate_schedule(phase) -> optax.Schedule:
    """The phase's schedule (a SchedulePlan) as a function of the phase's own step count; a
    phase that continues another's starts `start_step` steps into the span."""
    offset = -phase.start_step
    if phase.schedule == "poly_warmup":
        return optim.poly_warmup_schedule(
            phase.learning_rate,
            total_steps=phase.num_steps,
            warmup_fraction=phase.warmup_fraction,
            power=phase.decay_power,
            offset=offset,
        )
    if phase.schedule == "warmup_constant_decay":
        return optim.warmup_constant_decay_schedule(
            phase.learning_rate,
            total_steps=phase.num_steps,
            warmup_fraction=phase.warmup_fraction,
            constant_fraction=phase.constant_fraction,
            degree=phase.decay_power,
            offset=offset,
        )
    return optax.constant_schedule(phase.learning_rate)


def make_optimizer(optimizer_config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """LAMB, LANS or AdamW (a baseline) with BERT's decay exclusions and stacked layers;
    `bias_correction=False` drops Adam's bias correction (LAMB's and AdamW's; LANS keeps it);
    `group_layers` updates layers held one tree per layer stacked (`optim.on_stacked_layers`)."""
    tx = named_optimizer(optimizer_config, schedule)
    if optimizer_config.group_layers:
        return optim.on_stacked_layers(tx)
    return tx


def named_optimizer(optimizer_config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The optimizer `optimizer_config.name` names, for the stacked tree."""
    name = optimizer_config.name
    common = dict(
        b1=optimizer_config.b1,
        b2=optimizer_config.b2,
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
        weight_decay_mask=optim.bert_weight_decay_mask,
    )
    if name == "lamb":
        exclude = optimizer_config.exclude_norms_and_biases_from_trust_ratio
        return optim.lamb(
            schedule,
            **common,
            trust_ratio_mask=optim.bert_weight_decay_mask if exclude else None,
            max_global_norm=optimizer_config.max_global_norm,
            bias_correction=optimizer_config.bias_correction,
            stacked_layers=optim.stacked_layers_mask,
        )
    if name == "lans":
        return optim.lans(
            schedule,
            **common,
            max_global_norm=optimizer_config.max_global_norm,
            stacked_layers=optim.stacked_layers_mask,
        )
    if name == "adamw":
        tx = optax.adamw(
            schedule,
            b1=common["b1"],
            b2=common["b2"],
            eps=common["eps"],
            weight_decay=common["weight_decay"],
            mask=optim.bert_weight_decay_mask,
        )
        if not optimizer_config.bias_correction:  # DeepSpeed's Adam in the PLD recipe
            tx = optax.chain(
                optim.scale_by_adam(
                    common["b1"], common["b2"], common["eps"], bias_correction=False
                ),
                optax.add_decayed_weights(common["weight_decay"], optim.bert_weight_decay_mask),
                optax.scale_by_learning_rate(schedule),
            )
        if optimizer_config.max_global_norm:
            tx = optax.chain(optax.clip_by_global_norm(optimizer_config.max_global_norm), tx)
        return tx
    raise ValueError(f"optimizer name {name!r}; valid: lamb, lans, adamw")
