"""Ouroboros: model parallelism with delayed gradients, for BERT pretraining.

Yang, Huo, Wang, Huang, Carin, "Ouroboros: On Accelerating Training of Transformer-Based
Language Models", NeurIPS 2019 (arXiv 1909.06695). The variant `ouroboros` of every recipe
turns it on; `config.ouroboros` holds its fields.

The method
----------
Backpropagation through layers split across devices is *backward locked*: a device cannot
start its backward pass before every device above it has finished theirs. Ouroboros cuts the
model into K modules and lets every module run its backward pass at once, each on a gradient
that is a few iterations old. Module k (1 = bottom, K = top) is updated at iteration t with
the gradient of the batch of iteration t - (K - k), taken at the weights of that iteration:

    w_k^(t+1) = w_k^t - lr_t * d f(w^(t-K+k); x^(t-K+k)) / d w_k          (delay K - k)

This is the update of decoupled parallel backpropagation (DDG; Huo, Gu, Yang, Huang, ICML
2018, arXiv 1804.10574), which Ouroboros carries over to Transformer language models: the
authors' DDG code sets a module's delay to `num_splits - 1 - split_id`, the formula above.
The top module has no delay and the bottom one the longest. What is new in Ouroboros is the
placement. A language model's input embedding and its output projection are one tied matrix,
used by the bottom and by the top module; Ouroboros puts the first and the last module on the
same device, so the K modules take K - 1 devices in a ring (the snake that eats its tail), and
the tied matrix lives in one place. Its gradient is the sum of its two uses: the output
projection's, of batch t, and the input lookup's, of batch t - K + 1.

In lambjax: BERT's L encoder layers are split over S = K - 1 stages, L / S layers each, along
the mesh axis `stage` (mesh data x stage). Stage 0 holds module 1 (the embeddings and the
first ceil(L/2S) layers) and module K (the last floor(L/2S) layers, the MLM and NSP heads and
the tied word embedding); stage s >= 1 holds module s + 1. One iteration, per micro-batch:

  forward (locked, one stage at a time): stage 0 embeds batch t and runs module 1; stages
    1..S-1 run modules 2..K-1 in turn, each handing its output on with a `ppermute`; the last
    hands it back to stage 0, which runs module K, the heads and the loss and differentiates
    them: module K's gradient has no delay.
  backward (overlapping the forward): right after its own forward, while the stages above
    it run theirs, stage s replays the module it holds on the batch of d_s iterations ago
    (d_0 = K - 1 for module 1, d_s = K - 1 - s otherwise): from the input it stored then,
    with the weights of then (`replay='stale'`), under the same dropout masks (the keys are
    derived from the step), and pulls the output gradient it received (its mailbox) back
    through it with a vjp: exactly the delayed gradient above. One reverse `ppermute` then
    moves every input gradient one stage down, and stage 0's module-K input gradient round
    to stage S - 1: the next iteration's mailboxes.

The gradients then go through the recipe's optimizer (LAMB, LANS, AdamW) unchanged, as in the
paper's "Ouroboros + Adam": per-layer trust ratios are per-module quantities, and the global
gradient-norm clip sees the gradients of the different batches that are applied together.

What is carried between steps (`TrainState.pipeline`, checkpointed with the state, so a killed
run resumes bitwise): D = K - 1 ring-buffer slots, batch t in slot t % D.

  tokens   [S, D, G, T]     each stage's copy of the token ids, segments and masks in flight
  hidden   [S, D, G, T, H]  each stage's module inputs of those batches (unused on stage 0)
  mailbox  [S, G, T, H]     the output gradient each stage pulls back at the next step
  weights  [D, ...]         `replay='stale'` only: the embeddings and the encoder layers of
                            the last D iterations (the weights a replay needs)

With data parallelism (mesh data > 1) every data shard draws its own dropout masks (fold_in
of its index), so runs on different data-axis sizes agree only without dropout. A run
resumes with the num_modules it was checkpointed with (other buffer shapes are refused).

A phase starts with empty buffers (the phase transition changes their shapes): module k gets
its first gradient at the phase's step K - k, and until then neither its weights nor its
optimizer moments move (the pipeline fill of the authors' code, where a module skips its
first updates). The optimizer's step count is shared, so bias correction counts from the
phase's first step for every module; under LAMB and LANS, whose trust ratio fixes each
layer's update norm, that changes only the weight-decay share of the first updates.

`replay='current'` replays with the current weights instead: Features Replay (Huo, Gu, Huang,
NeurIPS 2018, arXiv 1807.04511), the same authors' memory-saving alternative, which needs no
weight history but whose gradient is no longer the exact delayed gradient.

Not from the paper (its method section could not be read here; the above follows DDG's
published formula and code): how many layers go to the first and the last module, and the
form of the paper's warm-up. `config.ouroboros.synchronous_steps` offers one reading of it,
that many steps of ordinary backpropagation at the start of each phase before the pipeline
fills (off by default); the recipes' learning-rate warm-up applies either way. The step is written
for XLA's SPMD partitioner: every stage runs the same program, each branch under `lax.cond`
on the stage index, and collectives only outside the branches. A forward hand-over is a
`ppermute` between its two stages only, so a stage that is replaying does not hold it up.
Per micro-batch the critical path is the longer of the forward climb plus module K's forward
and backward, and a stage's forward end plus its replay (which recomputes its forward),
against the sum of every module's forward and backward on one device; micro-batches run one
after another. benchmarks/ouroboros.py adds measured times up along it and along GPipe's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lambjax.models import bert, pretraining
from lambjax.train import step as step_lib
from lambjax.train.state import TrainState

REPLAYS = ("stale", "current")
TOKEN_KEYS = ("input_ids", "segment_ids", "input_mask")


@dataclasses.dataclass(frozen=True)
class Split:
    """K modules of an L-layer encoder on S = K - 1 stages of L / S layers each."""

    num_modules: int  # K >= 2
    num_layers: int  # L, a multiple of K - 1

    def __post_init__(self):
        k, n = self.num_modules, self.num_layers
        if not isinstance(k, int) or k < 2:
            raise ValueError(f"num_modules={k!r} must be an integer >= 2")
        if n % (k - 1):
            raise ValueError(
                f"{k} modules take {k - 1} stages of equal depth, which {n} layers do not "
                f"fill; valid num_modules: {_valid_modules(n)}"
            )

    @property
    def stages(self) -> int:
        return self.num_modules - 1

    @property
    def per_stage(self) -> int:
        return self.num_layers // self.stages

    @property
    def first(self) -> int:
        """Layers of module 1 (on stage 0, below module K's)."""
        return (self.per_stage + 1) // 2

    @property
    def last(self) -> int:
        """Layers of module K (on stage 0)."""
        return self.per_stage - self.first

    def module_of_layer(self, index: int) -> int:
        if index < self.first:
            return 1
        if index >= self.num_layers - self.last:
            return self.num_modules
        return 2 + (index - self.first) // self.per_stage

    def layer_delays(self) -> np.ndarray:
        """[L]: K - k for each layer's module k."""
        return np.array(
            [self.num_modules - self.module_of_layer(i) for i in range(self.num_layers)],
            np.int32,
        )


def _valid_modules(num_layers: int) -> list[int]:
    return [1] + [s + 1 for s in range(1, num_layers + 1) if num_layers % s == 0]


def check(num_modules: int, num_layers: int) -> None:
    """Raises ValueError where K modules cannot split `num_layers` layers (K = 1: off)."""
    if num_modules != 1:
        Split(num_modules, num_layers)


# ----------------------------------------------------------------------------------------
# The state carried between steps


def init_pipeline(split: Split, params, *, global_batch_size: int, seq_len: int, dtype, replay):
    """Empty buffers (module k's first K - k steps have no gradient yet)."""
    stages = slots = split.stages
    hidden = params["embeddings"]["word"]["embedding"].shape[1]
    rows = (stages, slots, global_batch_size, seq_len)
    pipeline = {
        "tokens": {k: jnp.zeros(rows, jnp.int32) for k in TOKEN_KEYS},
        "hidden": jnp.zeros(rows + (hidden,), dtype),
        "mailbox": jnp.zeros((stages, global_batch_size, seq_len, hidden), dtype),
    }
    if replay == "stale":
        pipeline["weights"] = jax.tree.map(
            lambda x: jnp.zeros((slots,) + x.shape, x.dtype), _replayed(params)
        )
    return pipeline


def _replayed(params) -> dict:
    """The parameters a replay reads: the embeddings and the encoder layers."""
    return {"embeddings": params["embeddings"], "layers": params["encoder"]["layers"]}


def pipeline_shardings(abstract_pipeline, param_shardings, mesh):
    """Buffers split over stage x data; the weight history like the parameters it copies."""
    rows = NamedSharding(mesh, P("stage", None, "data"))
    shardings = {
        "tokens": {k: rows for k in TOKEN_KEYS},
        "hidden": rows,
        "mailbox": NamedSharding(mesh, P("stage", "data")),
    }
    if "weights" in abstract_pipeline:
        shardings["weights"] = jax.tree.map(
            lambda s: NamedSharding(mesh, P(None, *s.spec)), _replayed(param_shardings)
        )
    return shardings


# ----------------------------------------------------------------------------------------
# The step


def train_step(
    state: TrainState,
    batch: dict,
    rng: jax.Array,
    *,
    split: Split,
    replay: str,
    mesh: jax.sharding.Mesh,
    model_config: bert.BertConfig,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    grad_accum_steps: int,
    nsp_loss_weight: float = 1.0,
    synchronous_steps: int = 0,
) -> tuple[TrainState, dict]:
    """One Ouroboros iteration: the delayed gradients, then the update of every module that
    has one. The counterpart of lambjax.train.step.train_step (same metrics).

    The first `synchronous_steps` steps of a phase are ordinary backpropagation (a warm-up;
    the pipeline then fills from empty), the rest pipelined."""
    settings = dict(
        model_config=model_config,
        optimizer=optimizer,
        schedule=schedule,
        grad_accum_steps=grad_accum_steps,
        nsp_loss_weight=nsp_loss_weight,
    )
    pipelined = functools.partial(
        _pipelined_step, split=split, replay=replay, mesh=mesh, **settings
    )
    if not synchronous_steps:
        return pipelined(state, batch, rng, state.step)

    def synchronous(state, batch, rng):
        new_state, metrics = step_lib.train_step(state, batch, rng, **settings)
        metrics["ouroboros_modules_updated"] = jnp.float32(split.num_modules)
        return new_state, metrics

    def delayed(state, batch, rng):  # its own dropout keys: not those of the warm-up steps
        pipeline_rng = jax.random.fold_in(rng, _PIPELINE_STREAM)
        return pipelined(state, batch, pipeline_rng, state.step - synchronous_steps)

    return jax.lax.cond(state.step < synchronous_steps, synchronous, delayed, state, batch, rng)


# fold_in constant of the pipelined steps' keys after a synchronous warm-up.
_PIPELINE_STREAM = 0x4F5552


def _pipelined_step(
    state,
    batch,
    rng,
    iteration,
    *,
    split,
    replay,
    mesh,
    model_config,
    optimizer,
    schedule,
    grad_accum_steps,
    nsp_loss_weight,
):
    """The pipelined step; `iteration` counts the steps since the pipeline started."""
    grads, stats, pipeline = pipeline_gradients(
        state.params,
        state.pipeline,
        batch,
        rng,
        iteration,
        split=split,
        replay=replay,
        mesh=mesh,
        model_config=model_config,
        grad_accum_steps=grad_accum_steps,
        nsp_loss_weight=nsp_loss_weight,
    )
    metrics = step_lib.metrics_from_stats(stats)
    loss = metrics["mlm_loss"] + nsp_loss_weight * metrics["nsp_loss"]
    active = active_modules(split, iteration, state.params)
    updated, update_metrics = step_lib.apply_if_finite(state, grads, loss, optimizer, 0)
    params = jax.tree.map(_select, active, updated.params, state.params)
    opt_state = _select_optimizer_state(optimizer, active, updated.opt_state, state.opt_state)
    if "weights" in pipeline:  # this step's weights, for the replays of the next D steps
        slot = iteration % split.stages
        pipeline["weights"] = jax.tree.map(
            lambda history, w: jax.lax.dynamic_update_index_in_dim(history, w, slot, 0),
            pipeline["weights"],
            _replayed(state.params),
        )
    new_state = updated.replace(params=params, opt_state=opt_state, pipeline=pipeline)
    update_metrics["update_norm"] = optax.global_norm(
        jax.tree.map(jnp.subtract, params, state.params)
    )
    delays = jnp.arange(split.num_modules)  # module K - d has delay d
    metrics.update(
        loss=loss,
        learning_rate=schedule(state.step),
        param_norm=optax.global_norm(state.params),
        ouroboros_modules_updated=jnp.sum(iteration >= delays).astype(jnp.float32),
        **update_metrics,
    )
    metrics.update(step_lib.trust_ratio_metrics(new_state.opt_state))
    return new_state, metrics


def active_modules(split: Split, step: jax.Array, params):
    """A tree like `params`: whether each leaf (each layer, for the stacked layers) has a
    gradient at `step`. Module k has one from step K - k on."""
    layers = step >= jnp.asarray(split.layer_delays())
    first = step >= split.num_modules - 1
    active = jax.tree.map(lambda _: jnp.bool_(True), params)  # module K's and the heads
    active["embeddings"] = jax.tree.map(lambda _: first, params["embeddings"])
    active["embeddings"]["word"] = jax.tree.map(
        lambda _: jnp.bool_(True), active["embeddings"]["word"]
    )
    active["encoder"]["layers"] = jax.tree.map(lambda _: layers, params["encoder"]["layers"])
    return active


def _select(active, new, old):
    """`new` where active (per leading index for a per-layer flag), else `old`."""
    active = active.reshape(active.shape + (1,) * (new.ndim - active.ndim))
    return jnp.where(active, new, old)


def _select_optimizer_state(optimizer, active, new, old):
    """The new optimizer state, but the old moments of modules without a gradient yet."""
    flags = optax.tree_map_params(
        optimizer,
        lambda _, flag: flag,
        new,
        active,
        transform_non_params=lambda _: jnp.bool_(True),
    )
    return jax.tree.map(_select, flags, new, old)


def pipeline_gradients(
    params,
    pipeline,
    batch,
    rng,
    step,
    *,
    split: Split,
    replay: str,
    mesh,
    model_config: bert.BertConfig,
    grad_accum_steps: int,
    nsp_loss_weight: float,
):
    """(Delayed gradients in the layout of `params`, the loss statistics of `batch`, the
    updated buffers). Zero gradients where a module has none yet."""
    shift = split.last  # stage 0 holds module K's layers, then module 1's: roll them there

    def roll(layers, by, axis=0):
        return jax.tree.map(lambda x: jnp.roll(x, by, axis=axis), layers) if shift else layers

    encoder = params["encoder"]
    local = {
        "embeddings": params["embeddings"],
        "layers": roll(encoder["layers"], shift),
        "heads": params["heads"],
        "final": encoder.get("final_layer_norm", {}),
    }
    buffers = {k: v for k, v in pipeline.items() if k != "weights"}
    weights = None
    if "weights" in pipeline:
        weights = {
            "embeddings": pipeline["weights"]["embeddings"],
            "layers": roll(pipeline["weights"]["layers"], shift, axis=1),
        }
    replicated, stage = P(), P("stage")
    local_specs = {
        "embeddings": replicated,
        "layers": stage,
        "heads": replicated,
        "final": replicated,
    }
    buffer_specs = {
        "tokens": P("stage", None, "data"),
        "hidden": P("stage", None, "data"),
        "mailbox": P("stage", "data"),
    }
    weight_specs = (
        None if weights is None else {"embeddings": replicated, "layers": P(None, "stage")}
    )
    device_step = functools.partial(
        _device_step,
        split=split,
        config=model_config,
        grad_accum_steps=grad_accum_steps,
        nsp_loss_weight=nsp_loss_weight,
        data_shards=mesh.shape["data"],
    )
    grads, stats, buffers = jax.shard_map(
        device_step,
        mesh=mesh,
        in_specs=(local_specs, weight_specs, buffer_specs, P("data"), replicated, replicated),
        out_specs=(local_specs, replicated, buffer_specs),
        check_vma=False,
    )(local, weights, buffers, batch, rng, step)
    encoder_grads = {"layers": roll(grads["layers"], -shift)}
    if "final_layer_norm" in encoder:
        encoder_grads["final_layer_norm"] = grads["final"]
    grads = {"embeddings": grads["embeddings"], "encoder": encoder_grads, "heads": grads["heads"]}
    if weights is not None:
        buffers["weights"] = pipeline["weights"]
    return grads, stats, buffers


def _device_step(
    params,
    weights,
    buffers,
    batch,
    rng,
    step,
    *,
    split,
    config,
    grad_accum_steps,
    nsp_loss_weight,
    data_shards,
):
    """One stage's part of the iteration (inside shard_map: `batch` is this data shard's rows,
    `params["layers"]` this stage's L / S layers, the buffers this stage's)."""
    stages, per_stage, first, last = split.stages, split.per_stage, split.first, split.last
    num_layers = split.num_layers
    stage = jax.lax.axis_index("stage")
    buffers = jax.tree.map(lambda x: x[0], buffers)  # drop the stage axis (size 1 here)
    delay = jnp.where(stage == 0, stages, stages - stage)  # of the module this stage replays
    old_slot, new_slot = (step - delay) % stages, step % stages
    filled = step >= delay

    def at(slot):
        return lambda x: jax.lax.dynamic_index_in_dim(x, slot, keepdims=False)

    # Losses are normalised by the global batch's counts, as in lambjax.train.step.
    mlm_total = jnp.maximum(
        jax.lax.psum(jnp.sum(batch["masked_lm_weights"].astype(jnp.float32)), "data"), 1e-9
    )
    nsp_total = jax.lax.psum(jnp.float32(batch["input_ids"].shape[0]), "data")
    if weights is None:  # Features Replay: the current weights
        replay_embeddings, replay_layers = params["embeddings"], params["layers"]
    else:
        replay_embeddings = jax.tree.map(at(old_slot), weights["embeddings"])
        replay_layers = jax.tree.map(at(old_slot), weights["layers"])
    old_tokens = jax.tree.map(at(old_slot), buffers["tokens"])
    old_hidden = at(old_slot)(buffers["hidden"])
    if data_shards > 1:  # each shard its own dropout masks (the same on one shard)
        rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
    step_rng = jax.random.fold_in(rng, step)
    old_rng = jax.random.fold_in(rng, jnp.maximum(step - delay, 0))

    def run_layers(layers, h, mask, rng, first_index):
        # The model's layer loop, its dropout key per layer fold_in(rng, global index).
        bias = bert.attention_bias(mask)
        h, _ = bert.run_layers(
            config,
            layers,
            h,
            bias,
            rng=rng,
            keep=None,
            scale=None,
            first_index=first_index,
            token_mask=None,
        )
        return h

    def module_1(embeddings, layers, tokens, rng):
        # The model's key use: split(micro-batch key) -> (embeddings, layers).
        embeddings_rng, layers_rng = jax.random.split(rng)
        h = bert.Embeddings(config).apply(
            {"params": embeddings},
            tokens["input_ids"],
            tokens["segment_ids"],
            False,
            rngs={"dropout": embeddings_rng},
        )
        return run_layers(layers, h, tokens["input_mask"], layers_rng, 0)

    def module_k(layers, heads, final, word, h, microbatch, rng):
        if last:
            h = run_layers(
                layers, h, microbatch["input_mask"], jax.random.split(rng)[1], num_layers - last
            )
        if config.layer_norm == "pre":
            h = bert.FinalNorm(config).apply({"params": final}, h)
        logits = bert.Heads(config).apply(
            {"params": heads}, h, microbatch["masked_lm_positions"], word
        )
        stats = pretraining.stats_from_logits(*logits, microbatch)
        loss = stats["mlm_loss_sum"] / mlm_total + nsp_loss_weight * (
            stats["nsp_loss_sum"] / nsp_total
        )
        return loss, stats

    def slots(tree, lo, hi):
        return jax.tree.map(lambda x: x[lo:hi], tree)

    def pad(tree, lo):  # a gradient of slots lo.. -> all of this stage's slots
        return jax.tree.map(
            lambda g: jnp.pad(g, [(lo, per_stage - lo - g.shape[0])] + [(0, 0)] * (g.ndim - 1)),
            tree,
        )

    backward_ring = [(s, (s - 1) % stages) for s in range(stages)]
    word = params["embeddings"]["word"]["embedding"]

    def microbatch_step(carry, xs):
        microbatch, tokens_then, hidden_then, mailbox, index = xs
        rng = jax.random.fold_in(step_rng, index)
        rng_then = jax.random.fold_in(old_rng, index)
        tokens = {k: microbatch[k] for k in TOKEN_KEYS}
        zeros = jnp.zeros(hidden_then.shape, hidden_then.dtype)

        # The backward of a stage: replay the module held there on the batch of `delay`
        # steps ago and pull its stored output gradient back through it.
        def replay_first():
            def f(embeddings, layers):
                return module_1(embeddings, layers, tokens_then, rng_then)

            layers = slots(replay_layers, last, per_stage)
            _, vjp = jax.vjp(f, replay_embeddings, layers)
            g_embeddings, g_layers = vjp(mailbox)
            return g_embeddings, pad(g_layers, last), zeros

        def replay_middle(first_index):
            def f(layers, h):
                return run_layers(
                    layers,
                    h,
                    tokens_then["input_mask"],
                    jax.random.split(rng_then)[1],
                    first_index,
                )

            _, vjp = jax.vjp(f, replay_layers, hidden_then)
            g_layers, delta = vjp(mailbox)
            return jax.tree.map(jnp.zeros_like, replay_embeddings), g_layers, delta

        replay_shapes = jax.eval_shape(replay_first)

        def replay_on(j):
            """Stage j's replay (zeros elsewhere). It runs in the tick after stage j's
            forward, beside stage j + 1's forward (or module K's on stage 0), so the
            backward of every stage overlaps the forward of the stages above it."""
            if stages == 1:
                return replay_first()
            if j == 0:
                replay = replay_first
            else:
                replay = functools.partial(replay_middle, first + (j - 1) * per_stage)
            return jax.lax.cond(
                stage == j,
                replay,
                lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), replay_shapes),
            )

        # Forward, locked: stage 0, 1, ..., S - 1, and back to stage 0. Each hand-over
        # involves only its two stages, so a replay elsewhere does not hold it up.
        h = jax.lax.cond(
            stage == 0,
            lambda: module_1(
                params["embeddings"], slots(params["layers"], last, per_stage), tokens, rng
            ),
            lambda: zeros,
        )
        stage_input = zeros
        replays = []
        for i in range(1, stages):
            h = jax.lax.ppermute(h, "stage", [(i - 1, i)])
            stage_input = jnp.where(stage == i, h, stage_input)
            h = jax.lax.cond(
                stage == i,
                lambda h, i=i: run_layers(
                    params["layers"],
                    h,
                    tokens["input_mask"],
                    jax.random.split(rng)[1],
                    first + (i - 1) * per_stage,
                ),
                lambda h: h,
                h,
            )
            replays.append(replay_on(i - 1))
        if stages > 1:
            h = jax.lax.ppermute(h, "stage", [(stages - 1, 0)])

        # Module K on stage 0: the loss and its gradient, no delay; meanwhile the last
        # stage replays.
        def top(h):
            def f(layers, heads, final, word, h):
                return module_k(layers, heads, final, word, h, microbatch, rng)

            primals = (slots(params["layers"], 0, last), params["heads"], params["final"], word, h)
            loss, vjp, stats = jax.vjp(f, *primals, has_aux=True)
            return stats, vjp(jnp.ones_like(loss))

        top_shapes = jax.eval_shape(top, h)
        stats, (g_last, g_heads, g_final, g_word, delta_top) = jax.lax.cond(
            stage == 0,
            top,
            lambda h: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), top_shapes),
            h,
        )
        replays.append(replay_on(stages - 1))
        replayed = jax.tree.map(lambda *parts: sum(parts[1:], parts[0]), *replays)
        g_embeddings, g_layers, delta = jax.tree.map(
            lambda g: jnp.where(filled, g, jnp.zeros_like(g)), replayed
        )
        g_embeddings["word"]["embedding"] = g_embeddings["word"]["embedding"] + g_word
        grads = {
            "embeddings": g_embeddings,
            "layers": jax.tree.map(jnp.add, g_layers, pad(g_last, 0)),
            "heads": g_heads,
            "final": g_final,
        }
        send = jnp.where(stage == 0, delta_top, delta)
        received = jax.lax.ppermute(send, "stage", backward_ring) if stages > 1 else send
        carry = jax.tree.map(jnp.add, carry, (grads, stats))
        return carry, (stage_input, received)

    n = grad_accum_steps
    split_rows = functools.partial(step_lib.split_microbatches, num_microbatches=n)
    xs = (
        split_rows(batch),
        split_rows(old_tokens),
        split_rows(old_hidden),
        split_rows(buffers["mailbox"]),
        jnp.arange(n),
    )
    zero_grads = {
        "embeddings": params["embeddings"],
        "layers": params["layers"],
        "heads": params["heads"],
        "final": params["final"],
    }
    zero_stats = {k: jnp.zeros((), jnp.float32) for k in step_lib.STAT_KEYS}
    init = jax.tree.map(jnp.zeros_like, (zero_grads, zero_stats))
    (grads, stats), (stage_inputs, received) = jax.lax.scan(microbatch_step, init, xs)

    def merge_rows(x):  # the inverse of split_microbatches
        return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

    grads["layers"] = jax.lax.psum(grads["layers"], "data")
    for name in ("embeddings", "heads", "final"):
        grads[name] = jax.lax.psum(grads[name], ("data", "stage"))
    stats = jax.lax.psum(stats, ("data", "stage"))

    def write(buffer, value):
        return jax.lax.dynamic_update_index_in_dim(buffer, value, new_slot, 0)

    new_buffers = {
        "tokens": {k: write(buffers["tokens"][k], batch[k]) for k in TOKEN_KEYS},
        "hidden": write(buffers["hidden"], merge_rows(stage_inputs)),
        "mailbox": merge_rows(received),
    }
    return grads, stats, jax.tree.map(lambda x: x[None], new_buffers)
