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
The MLM decoder is tied to the word embeddings, so it is frozen too; the heads' transform,
LayerNorm and bias, the pooler and the NSP classifier train in every stage.

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
from lambjax.models.bert import BertConfig


def _take_layers(x, index: slice):
    return x[index]


def _concatenate_layers(frozen, trainable):
    return jnp.concatenate([frozen, trainable], axis=0)


def split(
    tree: dict, num_frozen_layers: int, take: Callable[[Any, slice], Any] = _take_layers
) -> tuple[dict, dict | None]:
    """(trainable view, frozen part) of a params-shaped tree; (tree, None) when n = 0.

    The tree's layers are stacked or held one tree per layer (lambjax.models.layer_layout);
    the view keeps its layout. `take(leaf, slice)` cuts a stacked-layers leaf; pass another
    for trees whose leaves are not arrays (e.g. shardings: `lambda s, _: s`).
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
    return trainable, {"embeddings": tree["embeddings"], "encoder": frozen_encoder}


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
    return {"embeddings": frozen["embeddings"], "encoder": encoder, "heads": trainable["heads"]}


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
        if not 0 <= phase.num_frozen_layers < depth:
            raise ValueError(
                f"{where}.frozen_layers={phase.num_frozen_layers} must lie in [0, {depth}) for "
                f"its {depth} layers (at least the top layer trains)"
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
        changed = depth != previous_depth or phase.num_frozen_layers != previous.num_frozen_layers
        if changed and phase.optimizer_state == "keep":
            raise ValueError(
                f"{where} changes the trained layers (depth {previous_depth} -> {depth}, "
                f"frozen {previous.num_frozen_layers} -> {phase.num_frozen_layers}), so the "
                f"optimizer state cannot be kept: set {where}.optimizer_state='reset'"
            )
