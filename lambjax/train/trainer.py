"""The training loop: the phases of a run in order, with evaluation, metrics, checkpoints.

`train_and_evaluate(config, workdir)` runs every phase of `config.phase_order` that has not
finished yet. For each phase it compiles the steps once (`compile_steps`, the one place
lambjax calls `jax.jit`), takes its starting state by the restore order of
lambjax.train.phases, then iterates: a train step, and at their intervals log, evaluate and
save. A stop request (SIGTERM, or a pod's preemption notice) saves at the next step boundary
and ends the run; the same command continues it.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from clu import parameter_overview, periodic_actions

from lambjax import data as data_lib
from lambjax import distributed, sharding, storage
from lambjax.train import checkpointing, phases
from lambjax.train import config as config_lib
from lambjax.train import metrics as metrics_lib
from lambjax.train import step as step_lib
from lambjax.train import workdir as workdir_lib
from lambjax.train.phases import Phase


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


class CompiledSteps(NamedTuple):
    init_state: Callable  # rng -> TrainState
    init_optimizer: Callable  # params -> optimizer state
    train: Callable  # (state, batch, rng) -> (state, metrics); the state is donated
    eval: Callable  # (params, batch) -> summed statistics


@dataclasses.dataclass
class PhaseResult:
    name: str
    step: int  # the phase's step at the end of this run
    seconds: float  # wall time spent in the phase by this run
    eval_metrics: dict
    stopped: bool = False


def compile_steps(phase: Phase) -> CompiledSteps:
    """The phase's functions, jitted with the shardings of its state and batches."""
    state = phase.state_shardings
    batch = sharding.batch_sharding(phase.mesh)
    replicated = sharding.replicated(phase.mesh)
    return CompiledSteps(
        init_state=jax.jit(phase.init_state, out_shardings=state),
        init_optimizer=jax.jit(phase.init_optimizer, out_shardings=state.opt_state),
        train=jax.jit(
            phase.train_step(),
            in_shardings=(state, batch, replicated),
            out_shardings=(state, replicated),
            donate_argnums=(0,),
        ),
        eval=jax.jit(
            phase.eval_step(), in_shardings=(state.params, batch), out_shardings=replicated
        ),
    )


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs the remaining phases; returns the last phase's final evaluation metrics."""
    workdir = storage.resolve(workdir)
    config_lib.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
    workdir_lib.check(config, workdir)
    for flag, path in data_lib.paths(config.data):
        storage.check_reachable(path, flag)
    writer = metrics_lib.create_writer(workdir)
    stop = distributed.StopRequest()
    results = []
    step_offset = 0
    try:
        for index, name in enumerate(config.phase_order):
            phase = phases.build_phase(config, name, index, step_offset)
            results.append(run_phase(config, workdir, phase, writer, stop))
            if results[-1].stopped:
                logging.info("Stopped in phase %s; rerun the same command to continue.", name)
                break
            step_offset += phase.config.num_steps
    finally:
        writer.close()
    log_summary(workdir, results)
    return results[-1].eval_metrics


def run_phase(config, workdir: str, phase: Phase, writer, stop) -> PhaseResult:
    """Trains one phase to its last step, or until a stop is requested."""
    started = time.perf_counter()
    ckpt = checkpointing.PhaseCheckpoints(
        workdir,
        phase.name,
        max_to_keep=config.max_checkpoints_to_keep,
        async_save=config.async_checkpointing,
    )
    steps = compile_steps(phase)
    state, data_state, step = phases.initial_state(
        config, workdir, phase, ckpt, steps.init_state, steps.init_optimizer
    )
    if step >= phase.config.num_steps:
        logging.info("Phase %s already finished (step %d).", phase.name, step)
        ckpt.close()
        return PhaseResult(phase.name, step, 0.0, {})
    if phase.index == 0 and step == 0:
        parameter_overview.log_parameter_overview(
            state.params, include_stats=False, msg=f"Parameters of {phase.model_config}"
        )
    loop = PhaseLoop(config, workdir, phase, writer, ckpt, steps, data_state)
    step, stopped = loop.run(state, step, stop)
    writer.flush()
    ckpt.close()
    return PhaseResult(
        phase.name, step, time.perf_counter() - started, loop.eval_metrics, stopped=stopped
    )


class PhaseLoop:
    """One phase's iterations, and what happens at the log, eval and checkpoint intervals."""

    def __init__(self, config, workdir, phase: Phase, writer, ckpt, steps, data_state):
        self.config, self.workdir, self.phase = config, workdir, phase
        self.writer, self.ckpt, self.steps = writer, ckpt, steps
        self.batch_sharding = sharding.batch_sharding(phase.mesh)
        self.train_iter = phase.batches(
            "train", phase.config.global_batch_size, config.seed + phase.index
        )
        if data_state is not None:
            self.train_iter.set_state(data_state)
        self.rng = jax.random.fold_in(jax.random.key(config.seed), phase.index)
        self.meta = phase.checkpoint_meta(config)
        self.throughput = phases.throughput_meter(config, phase)
        self.save_clock = checkpointing.SaveClock(
            config.checkpoint_every_minutes, config.log_every_steps
        )
        self.later_phases_flops = phases.later_phases_flops(config, phase)
        self.pending_metrics = []
        self.eval_metrics = {}

    def to_global(self, local_batch: dict) -> dict:
        """This process's rows of the global batch -> global arrays sharded over data x fsdp."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), local_batch
        )

    def run(self, state, step: int, stop) -> tuple[int, bool]:
        """(final step, whether a stop was requested)."""
        config, num_steps = self.config, self.phase.config.num_steps
        logging.info("Phase %s: training steps %d..%d", self.phase.name, step + 1, num_steps)
        hooks = []
        if config.profile and jax.process_index() == 0:
            logdir = metrics_lib.local_logdir(self.writer, self.workdir)
            hooks.append(periodic_actions.Profile(logdir=logdir, first_profile=step + 5))
        while step < num_steps:
            if stop.requested(step):
                self.save(step, state)
                return step, True
            batch = self.to_global(next(self.train_iter))
            state, metrics = self.steps.train(state, batch, self.rng)
            step += 1
            self.pending_metrics.append(metrics)
            for hook in hooks:
                hook(step)
            is_last = step == num_steps
            if step % config.log_every_steps == 0 or is_last:
                self.log(step, state)
            if step % config.eval_every_steps == 0 or is_last:
                self.evaluate(step, state.params)
            by_steps = step % config.checkpoint_every_steps == 0 or is_last
            if by_steps or self.save_clock.due(step):
                self.save(step, state)
        return step, False

    def log(self, step: int, state) -> None:
        """Means of the metrics since the last log (one device-to-host transfer)."""
        stacked = jax.device_get(jax.tree.map(lambda *xs: jnp.stack(xs), *self.pending_metrics))
        self.pending_metrics = []
        train = {k: float(np.mean(v)) for k, v in stacked.items()}
        train.update(self.throughput.measure(step))
        train["phase"] = self.phase.index + 1
        self.writer.write_scalars(
            self.phase.step_offset + step, {f"train/{k}": v for k, v in train.items()}
        )
        if jax.process_index() == 0:
            logging.info("%s", self.progress_line(step, train))
        check_nonfinite(state, step, self.config.max_consecutive_nonfinite_steps)

    def progress_line(self, step: int, train: dict) -> str:
        eta_phase = eta_run = None
        if "step_time_s" in train:  # later phases at this phase's FLOP rate
            eta_phase = (self.phase.config.num_steps - step) * train["step_time_s"]
            eta_run = eta_phase + self.later_phases_flops / train["flops_per_s"]
        return metrics_lib.progress_line(
            self.phase.name, step, self.phase.config.num_steps, train, eta_phase, eta_run
        )

    def evaluate(self, step: int, params) -> None:
        metrics = self.evaluation(params)
        if metrics:
            self.eval_metrics = metrics
            self.writer.write_scalars(
                self.phase.step_offset + step, {f"eval/{k}": v for k, v in metrics.items()}
            )
        self.throughput.reset(step)

    def evaluation(self, params) -> dict:
        """MLM loss and accuracy on the held-out split (the MLPerf metric), plus NSP."""
        config, phase = self.config, self.phase
        if "validation" not in phase.prepared.data_sources:
            logging.warning("Phase %s: no validation split was built; no evaluation.", phase.name)
            return {}
        totals = None
        batches = phase.batches("validation", config.eval_batch_size, config.seed, num_epochs=1)
        for index, batch in enumerate(batches):
            if config.eval_steps and index >= config.eval_steps:
                break
            stats = self.steps.eval(params, self.to_global(batch))
            totals = stats if totals is None else jax.tree.map(jnp.add, totals, stats)
        if totals is None:
            size = config.eval_batch_size
            logging.warning("Phase %s: no validation batch of %d; no evaluation.", phase.name, size)
            return {}
        metrics = jax.device_get(step_lib.metrics_from_stats(totals))
        return {k: float(v) for k, v in metrics.items()}

    def save(self, step: int, state) -> None:
        self.writer.flush()  # the metrics reach every checkpoint (in a bucket too)
        if not self.ckpt.steps():  # the phase's first checkpoint: the config it runs
            workdir_lib.save_config(self.config, self.workdir)
        self.ckpt.save(step, state, self.train_iter.get_state(), self.meta)
        self.save_clock.saved()


def check_nonfinite(state, step: int, limit: int) -> None:
    consecutive = int(jax.device_get(state.consecutive_nonfinite))
    if consecutive >= limit:
        raise TrainingStopped(
            f"{consecutive} consecutive steps ({step - consecutive + 1}..{step}) had a "
            f"non-finite loss or gradient and were skipped (limit: "
            f"max_consecutive_nonfinite_steps={limit})"
        )


def log_summary(workdir: str, results: list[PhaseResult]) -> None:
    """A few lines at the end: each phase's steps, time and final evaluation; where to look."""
    if jax.process_index() == 0:
        phases_run = [(r.name, r.step, r.seconds, r.eval_metrics) for r in results]
        checkpoints = checkpointing.checkpoint_dir(workdir, "<phase>")
        logging.info("%s", metrics_lib.run_summary(phases_run, workdir, checkpoints))
