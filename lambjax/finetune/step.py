"""The heads' losses and the pure fine-tuning train and eval steps (the loop jits them).

Span (SQuAD): the mean of the start and end positions' cross-entropies over the sequence
(run_squad.py). Classifier: cross-entropy over the labels, or for one output (STS-B) the
mean squared error. The update is lambjax.train.step's: skipped where the loss or gradient
is not finite.
"""

import jax
import jax.numpy as jnp
import optax

from lambjax.models import heads
from lambjax.models.config import BertConfig
from lambjax.train import step as step_lib
from lambjax.train.state import TrainState


def span_loss(start_logits, end_logits, start_positions, end_positions):
    start = optax.softmax_cross_entropy_with_integer_labels(start_logits, start_positions)
    end = optax.softmax_cross_entropy_with_integer_labels(end_logits, end_positions)
    return jnp.mean((start + end) / 2)


def classifier_loss(logits, labels):
    if logits.shape[-1] == 1:  # regression
        return jnp.mean((logits[:, 0] - labels.astype(jnp.float32)) ** 2)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def task_loss(kind: str, outputs, batch: dict):
    if kind == "span":
        return span_loss(*outputs, batch["start_positions"], batch["end_positions"])
    return classifier_loss(outputs, batch["labels"])


def train_step(
    state: TrainState,
    batch: dict,
    rng: jax.Array,
    *,
    model_config: BertConfig,
    kind: str,
    num_labels: int,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
) -> tuple[TrainState, dict]:
    """One optimizer step on one global batch; the new state and scalar metrics."""
    step_rng = jax.random.fold_in(rng, state.step)

    def loss_fn(params):
        outputs = heads.apply(model_config, kind, num_labels, params, batch, dropout_rng=step_rng)
        return task_loss(kind, outputs, batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    new_state, metrics = step_lib.apply_if_finite(state, grads, loss, optimizer, 0)
    metrics.update(loss=loss, learning_rate=schedule(state.step))
    return new_state, metrics


def eval_step(params, batch: dict, *, model_config: BertConfig, kind: str, num_labels: int):
    """The head's outputs without dropout: (start, end) logits, or class logits / scores."""
    return heads.apply(model_config, kind, num_labels, params, batch)
