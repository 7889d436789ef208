"""Multi-stage layerwise training (MSLT, "progressive stacking 2.0"): what a stage trains.

A stage is a phase with its own encoder depth (`phases.NAME.num_layers`) and a number of
bottom layers that only run forward (`phases.NAME.frozen_layers`). Going into a deeper stage
copies the current top layers on top (`grow_layers`); the layers of the earlier stages become
frozen.

With `frozen_layers = n > 0` the *trainable view* of the parameters is

    {"encoder": {"layers": layers[n:], "final_layer_norm"}, "heads": ...}

and the frozen part is the embeddings and layers[:n]. The train step differentiates with
respect to the trainable view only, so no backward pass runs through the frozen layers
(they sit under `stop_gradient` in the model, and nothing asks for their gradients), and the
optimizer state exists only for the trainable view. The embeddings are frozen with the
layers above them: training them would need the backward pass through every frozen layer.
The MLM decoder is tied to the word embeddings, so it is frozen too, unless the stage sets
`phases.NAME.train_decoder`: the word-embedding matrix then joins the trainable view
(`{"embeddings": {"word": ...}, ...}`) and is trained through the output projection only,
since the embeddings' output sits under `stop_gradient` (the input lookup's share of its
gradient is not computed). The heads' transform, LayerNorm and bias, the pooler and the NSP
classifier train in every stage.

A stage may also continue the schedule of the stage before it
(`phases.NAME.continue_schedule`): one warm-up and decay then spans the phases so joined
(`schedule_spans`), where by default each phase re-warms and decays to zero on its own.

With n = 0 the trainable view is the whole tree and nothing is split. With the layers held
one tree per layer (an unrolled run's train state, lambjax.train.layout) the view holds the
trees `layers_n ...` and the frozen part `layers_0 ... layers_{n-1}`: nothing is cut or
concatenated.

References:
  Yang et al., "Progressively Stacking 2.0: A Multi-stage Layerwise Training Method for BERT
  Training Speedup", 2020 (arXiv 2011.13635).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lambjax.models import layer_layout
from lambjax.models.config import BertConfig


def _take_layers(x, index: slice):
    return x[index]


def _concatenate_layers(frozen, trainable):
    return jnp.concatenate([frozen, trainable], axis=0)


def split(
    tree: dict,
    num_frozen_layers: int,
    take: Callable[[Any, slice], Any] = _take_layers,
    *,
    train_decoder: bool = False,
) -> tuple[dict, dict | None]:
    """(trainable view, frozen part) of a params-shaped tree; (tree, None) when n = 0.

    The tree's layers are stacked or held one tree per layer (lambjax.models.layer_layout);
    the view keeps its layout. `take(leaf, slice)` cuts a stacked-layers leaf; pass another
    for trees whose leaves are not arrays (e.g. shardings: `lambda s, _: s`). With
    `train_decoder` the word embeddings (the tied MLM decoder) are in the view.
    """
    n = num_frozen_layers
    if n == 0:
        return tree, None
    encoder = tree["encoder"]
    if layer_layout.is_per_layer(tree):
        frozen_keys = {layer_layout.layer_name(i) for i in range(n)}
        trainable_encoder = {k: v for k, v in encoder.items() if k not in frozen_keys}
        frozen_encoder = {k: encoder[k] for k in frozen_keys}
    else:
        trainable_encoder = {k: v for k, v in encoder.items() if k != "layers"}
        trainable_encoder["layers"] = jax.tree.map(
            lambda x: take(x, slice(n, None)), encoder["layers"]
        )
        frozen_encoder = {"layers": jax.tree.map(lambda x: take(x, slice(0, n)), encoder["layers"])}
    trainable = {"encoder": trainable_encoder, "heads": tree["heads"]}
    embeddings = tree["embeddings"]
    if train_decoder:
        trainable["embeddings"] = {"word": embeddings["word"]}
        embeddings = {k: v for k, v in embeddings.items() if k != "word"}
    return trainable, {"embeddings": embeddings, "encoder": frozen_encoder}


def merge(trainable: dict, frozen: dict | None, concatenate=_concatenate_layers) -> dict:
    """The full parameter tree again (the inverse of `split`)."""
    if frozen is None:
        return trainable
    frozen_encoder = frozen["encoder"]
    if "layers" in frozen_encoder:
        layers = jax.tree.map(concatenate, frozen_encoder["layers"], trainable["encoder"]["layers"])
        encoder = {**trainable["encoder"], "layers": layers}
    else:  # per layer: the trees side by side, nothing concatenated
        encoder = {**frozen_encoder, **trainable["encoder"]}
    embeddings = {**frozen["embeddings"], **trainable.get("embeddings", {})}
    return {"embeddings": embeddings, "encoder": encoder, "heads": trainable["heads"]}


def grow_layers(config: BertConfig, params: dict, num_layers: int) -> tuple[BertConfig, dict]:
    """Deepens the encoder to `num_layers` by copying the current top layers on top.

    With n current layers and k = num_layers - n new ones (k <= n), new layer n + i is a
    copy of layer n - k + i: the top k layers are repeated in order (3 -> 6 stacks layers
    0..2 again; 6 -> 8 copies layers 4, 5). For k > n the rule repeats.
    """
    current = config.num_layers
    if num_layers < current:
        raise ValueError(f"grow_layers: num_layers={num_layers} < current depth {current}")
    sources = list(range(current))
    while len(sources) < num_layers:
        k = min(num_layers - len(sources), len(sources))
        sources += sources[len(sources) - k :]
    index = jnp.asarray(sources)
    grown = jax.tree.map(lambda x: x[index], params["encoder"]["layers"])
    params = {**params, "encoder": {**params["encoder"], "layers": grown}}
    return dataclasses.replace(config, num_layers=num_layers), params


def check(phases) -> None:
    """The stages' depths and frozen layers across the run's phase plans: a stage may only
    grow the encoder, and one that changes what trains starts a fresh optimizer state."""
    for phase in phases:
        where, depth = f"config.phases.{phase.name}", phase.model.num_layers
        frozen, train_decoder = phase.step.num_frozen_layers, phase.step.train_decoder
        if not 0 <= frozen < depth:
            raise ValueError(
                f"{where}.frozen_layers={frozen} must lie in [0, {depth}) for "
                f"its {depth} layers (at least the top layer trains)"
            )
        if train_decoder and not frozen:
            raise ValueError(
                f"{where}.train_decoder=True, but the phase freezes no layers "
                f"(frozen_layers=0), so its decoder trains already; set it only on a stage "
                f"with frozen_layers > 0"
            )
        previous = phase.previous
        if previous is None:
            continue
        previous_depth = previous.model.num_layers
        if depth < previous_depth:
            raise ValueError(
                f"{where} has {depth} layers, fewer than the {previous_depth} of the phase "
                f"before it: stages may only grow the encoder"
            )
        changed = (
            depth != previous_depth
            or frozen != previous.step.num_frozen_layers
            or train_decoder != previous.step.train_decoder
        )
        if changed and phase.optimizer_state == "keep":
            raise ValueError(
                f"{where} changes the trained parameters (depth {previous_depth} -> {depth}, "
                f"frozen {previous.step.num_frozen_layers} -> {frozen}, "
                f"decoder trained {previous.step.train_decoder} -> {train_decoder}), so the "
                f"optimizer state cannot be kept: set {where}.optimizer_state='reset'"
            )


def schedule_spans(phases_config, phase_order) -> dict[str, tuple[int, int]]:
    """Phase name -> (steps its schedule spans, steps of that span before the phase).

    A phase with `continue_schedule` joins the schedule of the phase before it: the
    warm-up and decay of the joined phases is one, over their steps added up. Raises
    ValueError where a phase cannot continue: it is the first, or its schedule settings
    differ from those of the phase it continues.
    """
    groups: list[list[str]] = []
    for index, name in enumerate(phase_order):
        phase, where = phases_config[name], f"config.phases.{name}"
        if not phase.continue_schedule:
            groups.append([name])
            continue
        if index == 0:
            raise ValueError(
                f"{where}.continue_schedule=True, but it is the first phase: there is no "
                f"schedule to continue"
            )
        previous = phases_config[phase_order[index - 1]]
        for field in SCHEDULE_FIELDS:
            if phase[field] != previous[field]:
                raise ValueError(
                    f"{where}.continue_schedule=True needs the schedule of phase "
                    f"{phase_order[index - 1]!r}: {field}={phase[field]!r} there is "
                    f"{previous[field]!r}"
                )
        groups[-1].append(name)
    spans = {}
    for group in groups:
        total, start = sum(phases_config[name].num_steps for name in group), 0
        for name in group:
            spans[name] = (total, start)
            start += phases_config[name].num_steps
    return spans


# The settings one schedule is made of: a phase continuing another's must share them.
SCHEDULE_FIELDS = (
    "schedule",
    "learning_rate",
    "warmup_fraction",
    "constant_fraction",
    "decay_power",
)
