"""Ouroboros' delayed gradients on the mesh data x stage (lambjax.contrib.ouroboros.step
applies them).

One step, per micro-batch, inside `shard_map` (every stage runs the same program, each branch
under `lax.cond` on the stage index, the collectives outside the branches):
  forward   stage 0 embeds the batch and runs module 1; stages 1..S-1 run theirs in turn, each
            handing its output on with a `ppermute` between those two stages only; the last
            hands it back to stage 0, which runs module K, the heads and the loss and
            differentiates them (no delay).
  backward  right after its own forward, stage s replays the module it holds on the batch of
            d_s steps ago (d_0 = K - 1, d_s = K - 1 - s) from the input it stored then, under
            that step's dropout keys, and pulls its mailbox's output gradient back through it.
            One reverse `ppermute` moves every input gradient one stage down (stage 0's round
            to stage S - 1): the next step's mailboxes.

Carried between steps in `TrainState.method_state` (checkpointed, so a killed run resumes
bitwise), D = K - 1 ring-buffer slots, batch t in slot t % D:
  tokens   [S, D, G, T]     each stage's copy of the token ids, segments and masks in flight
  hidden   [S, D, G, T, H]  each stage's module inputs of those batches (unused on stage 0)
  mailbox  [S, G, T, H]     the output gradient each stage pulls back at the next step
  weights  [D, ...]         replay='stale' only: the embeddings and layers of the last D steps
With mesh data > 1 each data shard draws its own dropout masks (fold_in of its index), so
runs on different data-axis sizes agree only without dropout.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lambjax.contrib.ouroboros import stages as stages_lib
from lambjax.train import step as step_lib

if TYPE_CHECKING:
    from lambjax.contrib.ouroboros.step import OuroborosStep

TOKEN_KEYS = ("input_ids", "segment_ids", "input_mask")  # the batch's keys a stage stores

# Inside shard_map: a stage's parameters (its block of layers), the weight history, buffers.
_STAGE_PARAMS = {"embeddings": P(), "layers": P("stage"), "heads": P(), "final": P()}
_WEIGHT_HISTORY = {"embeddings": P(), "layers": P(None, "stage")}
_BUFFERS = {
    "tokens": P("stage", None, "data"),
    "hidden": P("stage", None, "data"),
    "mailbox": P("stage", "data"),
}


def delayed_gradients(params, carried, batch, rng, step, *, settings: OuroborosStep):
    """(Delayed gradients in the layout of `params`, the loss statistics of `batch`, the
    updated buffers). Zero gradients where a module has none yet."""
    split = settings.split
    encoder = params["encoder"]
    local = {
        "embeddings": params["embeddings"],
        "layers": stages_lib.stage_order(split, encoder["layers"]),
        "heads": params["heads"],
        "final": encoder.get("final_layer_norm", {}),
    }
    buffers = {k: v for k, v in carried.items() if k != "weights"}
    weights = None
    if "weights" in carried:
        weights = {
            "embeddings": carried["weights"]["embeddings"],
            "layers": stages_lib.stage_order(split, carried["weights"]["layers"], axis=1),
        }
    weight_specs = None if weights is None else _WEIGHT_HISTORY
    grads, stats, buffers = jax.shard_map(
        functools.partial(_device_step, settings=settings),
        mesh=settings.mesh,
        in_specs=(_STAGE_PARAMS, weight_specs, _BUFFERS, P("data"), P(), P()),
        out_specs=(_STAGE_PARAMS, P(), _BUFFERS),
        check_vma=False,
    )(local, weights, buffers, batch, rng, step)
    encoder_grads = {"layers": stages_lib.model_order(split, grads["layers"])}
    if "final_layer_norm" in encoder:
        encoder_grads["final_layer_norm"] = grads["final"]
    grads = {"embeddings": grads["embeddings"], "encoder": encoder_grads, "heads": grads["heads"]}
    if weights is not None:
        buffers["weights"] = carried["weights"]
    return grads, stats, buffers


class _Stage(NamedTuple):
    """One stage's view of the step (inside shard_map)."""

    model: stages_lib.StageModel
    index: jax.Array  # on the mesh axis `stage`
    params: dict  # embeddings, layers (this stage's block), heads, final
    replay_embeddings: dict  # the weights of the replays: of then, or the current ones
    replay_layers: dict
    filled: jax.Array  # whether the batch this stage replays exists yet
    totals: tuple  # (MLM weight, NSP count) of the global batch
    rng: jax.Array  # this step's key
    rng_then: jax.Array  # the key of the step this stage replays


class _Then(NamedTuple):
    """What a stage replays, of one micro-batch: its inputs of then, its output gradient."""

    tokens: dict
    hidden: jax.Array
    mailbox: jax.Array
    rng: jax.Array


def _device_step(params, weights, buffers, batch, rng, step, *, settings: OuroborosStep):
    """One stage's part of the iteration (inside shard_map: `batch` is this data shard's rows,
    `params["layers"]` this stage's L / S layers, the buffers this stage's)."""
    stages = settings.split.stages
    index = jax.lax.axis_index("stage")
    buffers = jax.tree.map(lambda x: x[0], buffers)  # drop the stage axis (size 1 here)
    delay = jnp.where(index == 0, stages, stages - index)  # of the module this stage replays
    old_slot, new_slot = (step - delay) % stages, step % stages
    totals = _global_totals(batch)
    if weights is None:  # Features Replay: the current weights
        replay_embeddings, replay_layers = params["embeddings"], params["layers"]
    else:
        replay_embeddings = jax.tree.map(_at(old_slot), weights["embeddings"])
        replay_layers = jax.tree.map(_at(old_slot), weights["layers"])
    old_tokens = jax.tree.map(_at(old_slot), buffers["tokens"])
    old_hidden = _at(old_slot)(buffers["hidden"])
    if settings.mesh.shape["data"] > 1:  # each shard its own dropout masks
        rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
    stage = _Stage(
        model=settings.model,
        index=index,
        params=params,
        replay_embeddings=replay_embeddings,
        replay_layers=replay_layers,
        filled=step >= delay,
        totals=totals,
        rng=jax.random.fold_in(rng, step),
        rng_then=jax.random.fold_in(rng, jnp.maximum(step - delay, 0)),
    )
    split_rows = functools.partial(
        step_lib.split_microbatches, num_microbatches=settings.grad_accum_steps
    )
    xs = (
        split_rows(batch),
        split_rows(old_tokens),
        split_rows(old_hidden),
        split_rows(buffers["mailbox"]),
        jnp.arange(settings.grad_accum_steps),
    )
    zero_stats = {k: jnp.zeros((), jnp.float32) for k in step_lib.STAT_KEYS}
    init = jax.tree.map(jnp.zeros_like, (params, zero_stats))
    microbatch_step = functools.partial(_microbatch_step, stage)
    (grads, stats), (stage_inputs, received) = jax.lax.scan(microbatch_step, init, xs)
    grads, stats = _sum_over_mesh(grads, stats)
    new_buffers = _next_buffers(buffers, batch, stage_inputs, received, new_slot)
    return grads, stats, jax.tree.map(lambda x: x[None], new_buffers)


def _at(slot):
    return lambda x: jax.lax.dynamic_index_in_dim(x, slot, keepdims=False)


def _global_totals(batch):
    """(MLM weight, NSP count) of the global batch: the losses' normalisers, as in
    lambjax.train.step."""
    mlm_total = jnp.maximum(
        jax.lax.psum(jnp.sum(batch["masked_lm_weights"].astype(jnp.float32)), "data"), 1e-9
    )
    nsp_total = jax.lax.psum(jnp.float32(batch["input_ids"].shape[0]), "data")
    return mlm_total, nsp_total


def _microbatch_step(stage: _Stage, carry, xs):
    """One micro-batch through the stages: the forward climb with the replays beside it,
    module K's gradient, and the input gradients handed one stage down."""
    microbatch, tokens_then, hidden_then, mailbox, index = xs
    rng = jax.random.fold_in(stage.rng, index)
    then = _Then(tokens_then, hidden_then, mailbox, jax.random.fold_in(stage.rng_then, index))
    tokens = {k: microbatch[k] for k in TOKEN_KEYS}
    h, stage_input, replays = _forward(stage, tokens, rng, then)
    stats, top_grads = _top_on_stage_zero(stage, h, microbatch, rng)
    replays.append(_replay_on(stage, stage.model.split.stages - 1, then))
    grads, delta = _stage_gradients(stage, replays, top_grads)
    send = jnp.where(stage.index == 0, top_grads[-1], delta)
    stages = stage.model.split.stages
    backward_ring = [(s, (s - 1) % stages) for s in range(stages)]
    received = jax.lax.ppermute(send, "stage", backward_ring) if stages > 1 else send
    carry = jax.tree.map(jnp.add, carry, (grads, stats))
    return carry, (stage_input, received)


def _forward(stage: _Stage, tokens, rng, then: _Then):
    """Forward, locked: stage 0, 1, ..., S - 1, and back to stage 0. Each hand-over involves
    only its two stages, so a replay elsewhere does not hold it up. Returns (the last stage's
    output, on stage 0; this stage's input; the replays of stages 0..S-2, each run in the tick
    after its own forward, beside the forward of the stage above it)."""
    model, params = stage.model, stage.params
    split = model.split
    zeros = jnp.zeros(then.hidden.shape, then.hidden.dtype)
    h = jax.lax.cond(
        stage.index == 0,
        lambda: stages_lib.first_module(
            model,
            params["embeddings"],
            stages_lib.first_module_layers(split, params["layers"]),
            tokens,
            rng,
        ),
        lambda: zeros,
    )
    stage_input = zeros
    replays = []
    for i in range(1, split.stages):
        h = jax.lax.ppermute(h, "stage", [(i - 1, i)])
        stage_input = jnp.where(stage.index == i, h, stage_input)
        h = jax.lax.cond(
            stage.index == i,
            lambda h, i=i: stages_lib.middle_module(
                model, i, params["layers"], h, tokens["input_mask"], rng
            ),
            lambda h: h,
            h,
        )
        replays.append(_replay_on(stage, i - 1, then))
    if split.stages > 1:
        h = jax.lax.ppermute(h, "stage", [(split.stages - 1, 0)])
    return h, stage_input, replays


def _top_on_stage_zero(stage: _Stage, h, microbatch, rng):
    """Module K on stage 0 (zeros elsewhere): (its loss statistics, the gradients of its
    layers, heads, final LayerNorm, word embedding as output projection and its input)."""

    def top(h):
        return stages_lib.top_gradients(stage.model, stage.params, h, microbatch, rng, stage.totals)

    shapes = jax.eval_shape(top, h)
    return jax.lax.cond(stage.index == 0, top, lambda h: _zeros(shapes), h)


def _replay_on(stage: _Stage, j: int, then: _Then):
    """Stage j's replay, zeros elsewhere: (the gradients of the embeddings, of this stage's
    layers, of the module's input)."""
    model = stage.model

    def replay_first():
        g_embeddings, g_layers = stages_lib.replay_first(
            model, stage.replay_embeddings, stage.replay_layers, then.tokens, then.rng, then.mailbox
        )
        return g_embeddings, g_layers, jnp.zeros(then.hidden.shape, then.hidden.dtype)

    def replay_middle():
        g_layers, delta = stages_lib.replay_middle(
            model,
            j,
            stage.replay_layers,
            then.hidden,
            then.tokens["input_mask"],
            then.rng,
            then.mailbox,
        )
        return jax.tree.map(jnp.zeros_like, stage.replay_embeddings), g_layers, delta

    if model.split.stages == 1:
        return replay_first()
    shapes = jax.eval_shape(replay_first)
    replay = replay_first if j == 0 else replay_middle
    return jax.lax.cond(stage.index == j, replay, lambda: _zeros(shapes))


def _zeros(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _stage_gradients(stage: _Stage, replays, top_grads):
    """(This stage's gradients of one micro-batch, its replay's input gradient): the replay's
    (zero before its batch exists) plus module K's on stage 0."""
    g_last, g_heads, g_final, g_word, _ = top_grads
    replayed = jax.tree.map(lambda *parts: sum(parts[1:], parts[0]), *replays)
    g_embeddings, g_layers, delta = jax.tree.map(
        lambda g: jnp.where(stage.filled, g, jnp.zeros_like(g)), replayed
    )
    g_embeddings["word"]["embedding"] = g_embeddings["word"]["embedding"] + g_word
    g_top_layers = stages_lib.pad_block(stage.model.split, g_last, 0)
    grads = {
        "embeddings": g_embeddings,
        "layers": jax.tree.map(jnp.add, g_layers, g_top_layers),
        "heads": g_heads,
        "final": g_final,
    }
    return grads, delta


def _sum_over_mesh(grads, stats):
    """Each stage's layer gradients summed over data; the rest over data and stage."""
    grads["layers"] = jax.lax.psum(grads["layers"], "data")
    for name in ("embeddings", "heads", "final"):
        grads[name] = jax.lax.psum(grads[name], ("data", "stage"))
    return grads, jax.lax.psum(stats, ("data", "stage"))


def _merge_rows(x):
    """The inverse of step.split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _next_buffers(buffers, batch, stage_inputs, received, slot):
    """This step's tokens and stage inputs written to `slot`; the new mailbox."""

    def write(buffer, value):
        return jax.lax.dynamic_update_index_in_dim(buffer, value, slot, 0)

    return {
        "tokens": {k: write(buffers["tokens"][k], batch[k]) for k in TOKEN_KEYS},
        "hidden": write(buffers["hidden"], _merge_rows(stage_inputs)),
        "mailbox": _merge_rows(received),
    }
