"""The fine-tuning run: build the task, start or resume, train, evaluate, write the results.

`finetune(config, workdir)` compiles its steps once, restores the run's latest checkpoint
if there is one (else starts from `config.init`), trains to the last step in the run loop it
shares with pretraining (lambjax.train.loop: log / eval / checkpoint intervals), then
scores the whole evaluation set and writes, on process 0:

  results.json            {"task": ..., "init": ..., "step": ..., "eval": {metric: value}}
  predictions.json        SQuAD: {question_id: answer}; v2.0 also null_odds.json
  predictions.tsv         GLUE: index<TAB>prediction (MNLI: _matched and _mismatched)
  metrics.jsonl, events   every logged scalar (TensorBoard)
  checkpoints/finetune/   Orbax checkpoints: the same command continues a killed run
  transformers/           the model for BertForQuestionAnswering /
                          BertForSequenceClassification (PostLN models)

Training batches are drawn without replacement from a permutation of the training features
per epoch (seeded; a step's batch depends only on the step, so a resumed run reads what the
original would have); the last partial batch of an epoch is left out. Evaluation pads the
set to whole batches with empty rows and scores every real row.
"""

import dataclasses
import functools
import json
import os
import time

import jax
import numpy as np
import optax
from absl import logging
from etils import epath

from lambjax import console, distributed, optim, sharding, storage
from lambjax.data import tokenization
from lambjax.finetune import config as config_lib
from lambjax.finetune import init as init_lib
from lambjax.finetune import step as step_lib
from lambjax.finetune import tasks
from lambjax.finetune.errors import FinetuneError
from lambjax.models import heads
from lambjax.models.config import BertConfig
from lambjax.train import checkpointing
from lambjax.train import loop as train_loop
from lambjax.train import metrics as metrics_lib
from lambjax.train import optimizer as optimizer_lib
from lambjax.train import state as state_lib
from lambjax.train.state import TrainState

CHECKPOINT_NAME = "finetune"


@dataclasses.dataclass
class FinetuneSetup:
    """Everything built for one fine-tuning run: its task, model, mesh and optimizer."""

    task: tasks.Task
    model_config: BertConfig
    params: dict | None  # host parameters to start from (unused when resuming)
    vocab_file: str
    lower_case: bool
    start: str  # where the encoder came from, for the log and results
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    num_steps: int

    @functools.cached_property
    def state_shardings(self) -> TrainState:
        abstract = jax.eval_shape(
            lambda p: TrainState.create(p, self.optimizer), self.abstract_params()
        )
        return state_lib.shardings(
            abstract,
            param_axes=heads.param_logical_axes(
                self.model_config, self.task.kind, self.task.num_labels
            ),
            mesh=self.mesh,
            optimizer=self.optimizer,
            num_frozen_layers=0,
        )

    def abstract_params(self):
        return jax.eval_shape(
            functools.partial(
                heads.init_params, self.model_config, self.task.kind, self.task.num_labels
            ),
            jax.random.key(0),
        )

    def abstract_state(self) -> TrainState:
        abstract = jax.eval_shape(
            lambda p: TrainState.create(p, self.optimizer), self.abstract_params()
        )
        return state_lib.with_shardings(abstract, self.state_shardings)


def compile_steps(setup: FinetuneSetup) -> train_loop.CompiledSteps:
    """The run's functions, jitted with the shardings of its state and batches."""
    bound = dict(
        model_config=setup.model_config, kind=setup.task.kind, num_labels=setup.task.num_labels
    )
    return train_loop.compile_steps(
        setup.mesh,
        setup.state_shardings,
        train_step=functools.partial(
            step_lib.train_step, optimizer=setup.optimizer, schedule=setup.schedule, **bound
        ),
        eval_step=functools.partial(step_lib.eval_step, **bound),
        init_optimizer=setup.optimizer.init,
    )


# ----------------------------------------------------------------------------------------
# Building a run's pieces


def _vocabulary(config, start: init_lib.Start, workdir: str) -> str:
    if config.vocab:
        if not epath.Path(config.vocab).is_file():
            raise FinetuneError(f"config.vocab={config.vocab!r}: no such file")
        return storage.local_copy(config.vocab)
    if start.vocab_file:
        return start.vocab_file
    if start.params is not None:
        raise FinetuneError(
            f"{start.description} has no vocabulary (vocab.txt) any more; give its "
            "vocab.txt as --config.vocab"
        )
    path = epath.Path(workdir) / "vocab.txt"  # scratch: trained on the training texts
    if jax.process_index() == 0 and not path.exists():
        lower_case = True if config.lower_case is None else config.lower_case
        texts = tasks.training_texts(config)
        tokenization.train_vocab(texts, config.vocab_size, lower_case, os.fspath(path))
    distributed.barrier("finetune-vocab")
    return storage.local_copy(os.fspath(path))


def _model_config(config, start: init_lib.Start, vocab_size: int) -> BertConfig:
    overrides = {k: v for k, v in config.model.to_dict().items() if v is not None}
    model_config = start.model_config
    if start.params is None:
        overrides.setdefault("vocab_size", vocab_size)
    elif vocab_size > model_config.vocab_size:
        raise FinetuneError(
            f"the vocabulary has {vocab_size} tokens but {start.description} embeds only "
            f"{model_config.vocab_size}: not this model's vocabulary"
        )
    try:
        model_config = dataclasses.replace(model_config, **overrides)
    except (ValueError, TypeError) as e:
        raise FinetuneError(f"config.model: {e}") from e
    if config.max_seq_length > model_config.max_position_embeddings:
        raise FinetuneError(
            f"config.max_seq_length={config.max_seq_length} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    return model_config


def _start_params(config, start, model_config, task) -> dict:
    """Host parameters: the start's encoder (and pooler) with a new head, or all random."""
    rng = jax.random.key(config.seed)
    # Jitted: initialising op by op takes seconds even for a tiny model.
    if start.params is None:
        init = functools.partial(heads.init_params, model_config, task.kind, task.num_labels)
        return jax.device_get(jax.jit(init)(rng))
    init = functools.partial(heads.init_head, model_config, task.kind, task.num_labels)
    head = jax.device_get(jax.jit(init)(rng))
    pretrained_pooler = start.params.get("heads", {}).get("pooler")
    if "pooler" in head and pretrained_pooler is not None:
        head["pooler"] = pretrained_pooler
    return heads.with_head(start.params, head)


def build_setup(config, workdir: str) -> FinetuneSetup:
    # Fine-tuning is data parallel: on several TPU slices the data axis crosses them.
    slices = sharding.slice_count(jax.devices())
    mesh = sharding.make_mesh(dict(config.mesh), dcn={"data": slices})
    config_lib.validate(config, mesh.shape["data"] * mesh.shape["fsdp"], jax.process_count())
    start = init_lib.load(config.init)
    vocab_file = _vocabulary(config, start, workdir)
    lower_case = init_lib.resolve_lower_case(config.lower_case, start, vocab_file)
    tokenizer = tokenization.load(vocab_file, lower_case)
    task = tasks.build(config, tokenizer, tokenization.special_ids(tokenizer))
    model_config = _model_config(config, start, tokenizer.get_vocab_size())
    num_train = len(task.train["input_ids"])
    if num_train < config.global_batch_size:
        raise FinetuneError(
            f"{config.data.train}: {num_train} training features, fewer than one batch "
            f"(config.global_batch_size={config.global_batch_size})"
        )
    num_steps = config.num_steps or max(
        1, int(num_train / config.global_batch_size * config.num_epochs)
    )
    schedule = optim.linear_warmup_decay_schedule(
        config.learning_rate, num_steps, config.warmup_fraction
    )
    return FinetuneSetup(
        task=task,
        model_config=model_config,
        params=_start_params(config, start, model_config, task),
        vocab_file=vocab_file,
        lower_case=lower_case,
        start=start.description,
        mesh=mesh,
        optimizer=optimizer_lib.make_optimizer(config.optimizer, schedule),
        schedule=schedule,
        num_steps=num_steps,
    )


# ----------------------------------------------------------------------------------------
# Running it


def _to_global(setup: FinetuneSetup, global_rows: dict) -> dict:
    """This process's slice of a global batch's rows, as global arrays over data x fsdp."""
    size = len(next(iter(global_rows.values())))
    per_process = size // jax.process_count()
    lo = jax.process_index() * per_process
    local = {k: v[lo : lo + per_process] for k, v in global_rows.items()}
    return train_loop.to_global(local, sharding.batch_sharding(setup.mesh))


def train_batch(arrays: dict, step: int, batch_size: int, seed: int) -> dict:
    """The global batch of `step` (0-based): epoch-wise permutations, partial batches left out."""
    num = len(arrays["input_ids"])
    per_epoch = num // batch_size
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num)
    rows = order[index * batch_size : (index + 1) * batch_size]
    return {k: v[rows] for k, v in arrays.items()}


def evaluate(
    setup: FinetuneSetup, steps: train_loop.CompiledSteps, params, batch_size: int
) -> tuple[dict, dict]:
    """Every eval set fully scored with the compiled `steps.eval`: (metrics, {file: text})."""
    metrics, files = {}, {}
    for eval_set in setup.task.eval_sets:
        num = len(eval_set.arrays["input_ids"])
        padded = -(-num // batch_size) * batch_size
        arrays = {
            k: np.concatenate([v, np.zeros((padded - num, *v.shape[1:]), v.dtype)])
            for k, v in eval_set.arrays.items()
        }
        outputs = []
        for lo in range(0, padded, batch_size):
            batch = _to_global(setup, {k: v[lo : lo + batch_size] for k, v in arrays.items()})
            outputs.append(jax.device_get(steps.eval(params, batch)))
        outputs = jax.tree.map(lambda *xs, n=num: np.concatenate(xs)[:n], *outputs)
        set_metrics, set_files = eval_set.score(outputs)
        prefix = f"{eval_set.name}_" if eval_set.name else ""
        metrics.update({prefix + k: v for k, v in set_metrics.items()})
        files.update(set_files)
    return metrics, files


def _write(workdir: str, name: str, text: str) -> None:
    if jax.process_index() == 0:
        storage.write_text(epath.Path(workdir) / name, text)  # never seen half-written


def finetune(config, workdir: str) -> dict:
    """Fine-tunes and evaluates; returns the final eval metrics (also in results.json)."""
    workdir = storage.resolve(workdir)
    storage.check_reachable(workdir, "--workdir")
    if (epath.Path(workdir) / "config.json").exists():  # lambjax.main saves its config there
        raise FinetuneError(
            f"--workdir={workdir} holds a pretraining run; fine-tuning needs a workdir of its "
            f"own (and config.init=workdir:{workdir} to start from that run)"
        )
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    console.log_to_file(workdir, console.process_log_name("finetune", jax.process_index()))
    setup = build_setup(config, workdir)
    logging.info(
        "Fine-tuning %s from %s: %d training features, %d steps of %d; lower_case=%s",
        setup.task.name,
        setup.start,
        len(setup.task.train["input_ids"]),
        setup.num_steps,
        config.global_batch_size,
        setup.lower_case,
    )
    steps = compile_steps(setup)
    ckpt = checkpointing.PhaseCheckpoints(
        workdir, CHECKPOINT_NAME, max_to_keep=config.max_checkpoints_to_keep, async_save=False
    )
    meta = {
        "task": setup.task.name,
        "init": config.init,
        "config": config.to_json_best_effort(),
        "model_config": dataclasses.asdict(setup.model_config),
        "vocab_file": setup.vocab_file,
        "lower_case": setup.lower_case,
    }
    restored = ckpt.restore_latest(setup.abstract_state())
    if restored is not None:
        for field in ("task", "init"):
            if restored.meta.get(field) != meta[field]:
                ckpt.close()
                raise FinetuneError(
                    f"{workdir} holds a fine-tuning run with {field}={restored.meta.get(field)!r}"
                    f", not {meta[field]!r}: use another --workdir"
                )
        logging.info("Resuming from the checkpoint at step %d", restored.step)
        state, step = restored.state, restored.step
    else:
        params = jax.device_put(setup.params, setup.state_shardings.params)
        state = TrainState.create(params, setup.optimizer, opt_state=steps.init_optimizer(params))
        state, step = jax.device_put(state, setup.state_shardings), 0
    setup.params = None  # the host copy is no longer needed
    writer = metrics_lib.create_writer(workdir)
    writer.resume_from(step)  # rows an interrupted run logged after the checkpoint go
    stop = distributed.StopRequest()
    try:
        job = FinetuneJob(config, setup, steps, writer, ckpt, meta, first_step=step)
        state, step, stopped = train_loop.run_job(job, state, step, stop)
        if stopped:
            logging.info("Stopped at step %d; rerun the same command to continue.", step)
            return {}
        eval_metrics, files = evaluate(setup, steps, state.params, config.eval_batch_size)
        writer.write_scalars(step, {f"eval/{k}": v for k, v in _scalars(eval_metrics).items()})
    finally:
        writer.close()
        ckpt.close()
    for name, text in files.items():
        _write(workdir, name, text)
    results = {"task": setup.task.name, "init": setup.start, "step": step, "eval": eval_metrics}
    _write(workdir, "results.json", json.dumps(results, indent=2) + "\n")
    if config.export_transformers:
        _export(setup, state.params, workdir)
    logging.info("%s", _summary(setup.task.name, eval_metrics, workdir))
    return eval_metrics


def _scalars(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}


class FinetuneJob:
    """The run as a job of the shared run loop (lambjax.train.loop): batches drawn by step,
    a log line with examples/s, the eval sets scored at the eval interval, checkpoints."""

    def __init__(self, config, setup: FinetuneSetup, steps, writer, ckpt, meta, first_step: int):
        self.config, self.setup, self.steps = config, setup, steps
        self.writer, self.ckpt, self.meta = writer, ckpt, meta
        self.num_steps = setup.num_steps
        self.intervals = train_loop.Intervals(
            log_every_steps=config.log_every_steps,
            eval_every_steps=config.eval_every_steps,
            checkpoint_every_steps=config.checkpoint_every_steps,
            eval_after_last_step=False,  # `finetune` scores the final state in full
        )
        self.rng = jax.random.key(config.seed)
        self.batch_args = (config.global_batch_size, config.seed)
        self.interval_start, self.interval_step = time.perf_counter(), None

    def batch(self, step: int) -> dict:
        if self.interval_step is None:  # throughput over each log interval (the first
            self.interval_start, self.interval_step = time.perf_counter(), step  # compiles)
        rows = train_batch(
            self.setup.task.train, step, self.config.global_batch_size, self.config.seed
        )
        return _to_global(self.setup, rows)

    def log(self, step: int, state, means: dict) -> None:
        seconds_per_step = (time.perf_counter() - self.interval_start) / (step - self.interval_step)
        self.interval_start, self.interval_step = time.perf_counter(), step
        train = dict(means, examples_per_s=self.config.global_batch_size / seconds_per_step)
        self.writer.write_scalars(step, {f"train/{k}": v for k, v in train.items()})
        if jax.process_index() == 0:
            logging.info(
                "%s step %d/%d | loss %.4f | lr %.2e | %.1f ex/s | ETA %s",
                self.setup.task.name,
                step,
                self.num_steps,
                train["loss"],
                train["learning_rate"],
                train["examples_per_s"],
                metrics_lib.format_duration(seconds_per_step * (self.num_steps - step)),
            )

    def evaluate(self, step: int, state) -> None:
        eval_metrics, _ = evaluate(
            self.setup, self.steps, state.params, self.config.eval_batch_size
        )
        self.writer.write_scalars(step, {f"eval/{k}": v for k, v in _scalars(eval_metrics).items()})

    def save(self, step: int, state) -> None:
        self.ckpt.save(step, state, {"step": step}, self.meta)

    def save_due(self, step: int) -> bool:
        return False  # by steps only


def _export(setup: FinetuneSetup, params, workdir: str) -> None:
    from lambjax.models import hf

    reason = hf.unexportable_reason(setup.model_config)
    if reason:
        logging.info("Not exported to transformers: %s.", reason)
        return
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(params, tiled=True)
    params = jax.device_get(params)
    if jax.process_index() == 0:
        with storage.local_folder(os.path.join(workdir, "transformers")) as out:
            hf.to_transformers_task(
                setup.model_config,
                params,
                out,
                labels=setup.task.labels,
                vocab_file=setup.vocab_file,
                lower_case=setup.lower_case,
            )


def _summary(task: str, metrics: dict, workdir: str) -> str:
    shown = ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
    )
    return f"{task}: {shown}\n  results: {os.path.join(workdir, 'results.json')}"
