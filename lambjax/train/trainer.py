"""The training loop: the phases of a run in order, with evaluation, metrics, checkpoints.

`train_and_evaluate(config, workdir)` resolves the config into a run plan
(lambjax.train.plan) and runs every phase that has not finished yet. For each phase it
compiles the steps once, takes its starting state by the restore order of
lambjax.train.phases, then runs the shared loop (lambjax.train.loop.run_job): a train step,
and at their intervals log, evaluate and save. A stop request (SIGTERM, or a pod's preemption
notice) saves at the next step boundary and ends the run; the same command continues it.
An evaluation that reaches `config.target` (lambjax.train.target) saves and ends the run.
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from absl import logging

from lambjax import console, distributed, sharding, storage
from lambjax import data as data_lib
from lambjax.train import checkpointing, loop, phases, prng, published, throughput, tracking
from lambjax.train import metrics as metrics_lib
from lambjax.train import plan as plan_lib
from lambjax.train import step as step_lib
from lambjax.train import target as target_lib
from lambjax.train import workdir as workdir_lib
from lambjax.train.noise_scale import NoiseScaleMeter
from lambjax.train.phases import Phase
from lambjax.train.plan import RunPlan

# The held-out split is masked with this seed whatever the run's seed, so every run (and every
# seed of a study) is evaluated on the same masked positions and their losses compare.
HELD_OUT_SEED = 0


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


# The exit status of a run that diverged (TrainingStopped), apart from a bad command's 2.
DIVERGED_STATUS = 3


@dataclasses.dataclass
class PhaseResult:
    name: str
    step: int  # the phase's step at the end of this run
    seconds: float  # wall time spent in the phase by this run
    eval_metrics: dict
    stopped: bool = False
    reached_target: bool = False  # an evaluation reached config.target: the run ends


def compile_steps(phase: Phase) -> loop.CompiledSteps:
    """The phase's functions, jitted with the shardings of its state and batches."""
    return loop.compile_steps(
        phase.mesh,
        phase.state_shardings,
        train_step=phase.train_step(),
        eval_step=phase.eval_step(),
        init_optimizer=phase.init_optimizer,
        init_state=phase.init_state,
        layout=(
            loop.StateLayout(phase.rest_shardings, phase.to_running, phase.to_rest)
            if phase.per_layer
            else None
        ),
    )


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs the remaining phases; returns the last phase's final evaluation metrics."""
    workdir = storage.resolve(workdir)
    start = published.load(config.init) if config.init else None
    run_plan = plan_lib.resolve(  # every check, before anything is written
        config,
        num_devices=jax.device_count(),
        process_count=jax.process_count(),
        num_slices=sharding.slice_count(jax.devices()),
        platform=jax.default_backend(),
        workdir=workdir,
        start=start,
    )
    workdir_lib.check(run_plan.config_json, workdir)
    console.log_to_file(workdir, console.process_log_name("train", jax.process_index()))
    reached = target_lib.read(workdir)
    if reached is not None:
        logging.info(
            "The run reached its target at phase %s step %d (%s); nothing more to do.",
            reached["phase"],
            reached["step"],
            target_lib.FILE,
        )
        return reached["eval"]
    diverged = target_lib.divergence(workdir)
    if diverged is not None:
        logging.warning(
            "This run diverged before (%s): %s. Resuming from its last finite checkpoint "
            "repeats that, bit for bit, unless the command changed.",
            target_lib.DIVERGED_FILE,
            diverged,
        )
        if jax.process_index() == 0:
            target_lib.clear_divergence(workdir)
    for flag, path in data_lib.paths(run_plan.data):
        storage.check_reachable(path, flag)
    vocabulary = phases.prepare_vocabulary(run_plan.data)
    run_plan = run_plan.with_vocab_size(vocabulary.size)
    datasets = phases.prepare_data(run_plan)
    phases.check_data(run_plan, datasets)
    trackers = []
    if jax.process_index() == 0:
        config_dict = json.loads(run_plan.config_json)
        trackers = tracking.create_writers(run_plan.tracking, config_dict, workdir)
    writer = metrics_lib.create_writer(workdir, extra=trackers)
    stop = distributed.StopRequest()
    results = []
    try:
        for plan in run_plan.phases:
            phase = phases.build_phase(plan, datasets[plan.batch.max_seq_length])
            results.append(run_phase(run_plan, workdir, phase, writer, stop, start))
            if results[-1].reached_target:
                record_target(run_plan, workdir, plan, results[-1])
                break
            if results[-1].stopped:
                logging.info("Stopped in phase %s; rerun the same command to continue.", plan.name)
                break
    except TrainingStopped as error:
        if jax.process_index() == 0:
            target_lib.record_divergence(workdir, str(error))
        raise
    finally:
        writer.close()
    log_summary(workdir, results)
    return results[-1].eval_metrics


def record_target(run_plan: RunPlan, workdir: str, plan, result: PhaseResult) -> None:
    """The run ends at its target: target_reached.json says where (its checkpoint is saved)."""
    global_step = plan.step_offset + result.step
    if jax.process_index() == 0:
        target_lib.record(
            workdir, run_plan.target, plan.name, result.step, global_step, result.eval_metrics
        )
    logging.info(
        "Target reached (%s) at phase %s step %d: the run ends here.",
        run_plan.target,
        plan.name,
        result.step,
    )


def run_phase(
    run_plan: RunPlan, workdir: str, phase: Phase, writer, stop, start=None
) -> PhaseResult:
    """Trains one phase to its last step, or until a stop is requested; the first phase from
    the published model `start` if there is one."""
    started = time.perf_counter()
    ckpt = checkpointing.PhaseCheckpoints(
        workdir,
        phase.name,
        max_to_keep=run_plan.max_checkpoints_to_keep,
        async_save=run_plan.async_checkpointing,
    )
    steps = compile_steps(phase)
    state, data_state, step = phases.initial_state(run_plan, workdir, phase, ckpt, steps, start)
    if step >= phase.plan.num_steps:
        logging.info("Phase %s already finished (step %d).", phase.name, step)
        ckpt.close()
        final = metrics_lib.eval_metrics_at(workdir, phase.plan.step_offset + step)
        return PhaseResult(phase.name, step, 0.0, final)
    writer.resume_from(phase.plan.step_offset + step)  # steps logged after it go
    if phase.index == 0 and step == 0:
        metrics_lib.log_parameters(state.params, phase.model_config, workdir, writer)
    state = steps.to_running(state)  # the layout the steps take (lambjax.train.layout)
    job = PhaseLoop(run_plan, workdir, phase, writer, ckpt, steps, data_state)
    if run_plan.eval_at_start and phase.index == 0 and step == 0:
        job.evaluate_at_start(state)
    try:
        step, stopped = job.train(state, step, stop)
    except BaseException:
        # A failed save, a divergence, Ctrl-C: any save still being written in the background
        # ends before the error's line is printed (nothing of Orbax's follows it).
        ckpt.abandon()
        raise
    writer.flush()
    ckpt.close()
    return PhaseResult(
        phase.name,
        step,
        time.perf_counter() - started,
        job.eval_metrics,
        stopped=stopped,
        reached_target=job.reached_target,
    )


class PhaseLoop:
    """One phase as a job of the shared run loop (lambjax.train.loop): its batches, its log
    line and throughput, its held-out evaluation, its checkpoints."""

    def __init__(self, run_plan: RunPlan, workdir, phase: Phase, writer, ckpt, steps, data_state):
        self.run_plan, self.workdir, self.phase = run_plan, workdir, phase
        self.writer, self.ckpt, self.steps = writer, ckpt, steps
        self.num_steps = phase.plan.num_steps
        self.intervals = loop.Intervals(
            log_every_steps=run_plan.log_every_steps,
            eval_every_steps=run_plan.eval_every_steps,
            checkpoint_every_steps=run_plan.checkpoint_every_steps,
            eval_after_last_step=True,
        )
        self.batch_sharding = sharding.batch_sharding(phase.mesh)
        self.train_iter = phase.batches(
            "train", phase.plan.batch.global_batch_size, run_plan.seed + phase.index
        )
        if data_state is not None:
            self.train_iter.set_state(data_state)
        key = prng.training_key(run_plan.seed, run_plan.prng_impl)
        self.rng = jax.random.fold_in(key, phase.index)
        self.meta = phase.checkpoint_meta(run_plan.config_json)
        self.throughput = throughput.phase_meter(run_plan, phase.plan)
        self.save_clock = checkpointing.SaveClock(
            run_plan.checkpoint_every_minutes, run_plan.log_every_steps
        )
        self.step_time = metrics_lib.MeanStepTime()
        decay = phase.plan.step.noise_scale_ema_decay
        self.noise_scale = None if decay is None else NoiseScaleMeter(decay)
        self.later_phases_flops = throughput.later_phases_flops(run_plan, phase.plan)
        self.eval_metrics = {}
        self.reached_target = False
        self.save_pending = False  # a save held back by non-finite steps (`finite`)

    def train(self, state, step: int, stop) -> tuple[int, bool]:
        """(final step, whether a stop was requested)."""
        logging.info("Phase %s: training steps %d..%d", self.phase.name, step + 1, self.num_steps)
        hooks = []
        if self.run_plan.profile and jax.process_index() == 0:
            logdir = metrics_lib.local_logdir(self.writer, self.workdir)
            hooks.append(Profile(logdir, first=step + 5))
        try:
            _, step, stopped = loop.run_job(self, state, step, stop, hooks)
        finally:
            for hook in hooks:
                hook.stop()
        return step, stopped

    def batch(self, step: int) -> dict:
        return loop.to_global(next(self.train_iter), self.batch_sharding)

    def log(self, step: int, state, means: dict) -> None:
        train = dict(means)
        train.update(self.throughput.measure(step))
        train["phase"] = self.phase.index + 1
        if self.noise_scale is not None:
            train.update(self.noise_scale.update(step, means))
        self.writer.write_scalars(
            self.phase.plan.step_offset + step, {f"train/{k}": v for k, v in train.items()}
        )
        if jax.process_index() == 0:
            logging.info("%s", self.progress_line(step, train))
        try:
            check_nonfinite(state, step, self.run_plan.max_consecutive_nonfinite_steps)
        except TrainingStopped as error:
            raise TrainingStopped(f"{error}; {self.last_checkpoint()}") from None

    def progress_line(self, step: int, train: dict) -> str:
        eta_phase = eta_run = None
        step_time = self.step_time.update(step, train.get("step_time_s"))
        if step_time is not None:  # later phases at this phase's FLOP rate
            eta_phase = (self.num_steps - step) * step_time
            flops_per_step = train["flops_per_s"] * train["step_time_s"]
            eta_run = eta_phase + self.later_phases_flops * step_time / flops_per_step
        return metrics_lib.progress_line(
            self.phase.name, step, self.num_steps, train, eta_phase, eta_run
        )

    def evaluate(self, step: int, state) -> bool:
        """The held-out evaluation, written; True where it reaches the run's target."""
        metrics = self.evaluation(state.params)
        if metrics:
            self.eval_metrics = metrics
            self.writer.write_scalars(
                self.phase.plan.step_offset + step, {f"eval/{k}": v for k, v in metrics.items()}
            )
        self.throughput.reset(step)
        target = self.run_plan.target
        self.reached_target = bool(metrics) and target is not None and target.reached(metrics)
        return self.reached_target

    def evaluate_at_start(self, state) -> None:
        """The held-out evaluation before the run's first step (`config.eval_at_start`),
        written at step 0; no target is read from it."""
        metrics = self.evaluation(state.params)
        if metrics:
            self.writer.write_scalars(0, {f"eval/{k}": v for k, v in metrics.items()})
        self.throughput.reset(0)

    def evaluation(self, params) -> dict:
        """MLM loss and accuracy on the held-out split (the MLPerf metric: every example once),
        plus NSP and the number of examples scored."""
        run_plan, phase = self.run_plan, self.phase
        if "validation" not in phase.prepared.data_sources:
            logging.warning("Phase %s: no validation split was built; no evaluation.", phase.name)
            return {}
        totals = None
        batches = phase.batches(  # every held-out example once, the last batch padded
            "validation", run_plan.eval_batch_size, HELD_OUT_SEED, num_epochs=1, pad_last_batch=True
        )
        for index, batch in enumerate(batches):
            if run_plan.eval_steps and index >= run_plan.eval_steps:
                break
            stats = self.steps.eval(params, loop.to_global(batch, self.batch_sharding))
            totals = stats if totals is None else jax.tree.map(jnp.add, totals, stats)
        if totals is None:
            size = run_plan.eval_batch_size
            logging.warning("Phase %s: no validation batch of %d; no evaluation.", phase.name, size)
            return {}
        metrics = jax.device_get(step_lib.metrics_from_stats(totals))
        # The held-out examples scored (every example has an NSP weight, with NSP or without).
        return {"examples": float(totals["nsp_count"]), **{k: float(v) for k, v in metrics.items()}}

    def save(self, step: int, state) -> None:
        if not self.finite(step, state):
            return
        self.save_pending = False
        self.writer.flush()  # the metrics reach every checkpoint (in a bucket too)
        if not self.ckpt.steps():  # the phase's first checkpoint: the config it runs
            workdir_lib.save_config(self.run_plan.config_json, self.workdir)
        self.ckpt.save(step, self.steps.to_rest(state), self.train_iter.get_state(), self.meta)
        self.save_clock.saved()

    def save_due(self, step: int) -> bool:
        return self.save_pending or self.save_clock.due(step)

    def finite(self, step: int, state) -> bool:
        """Whether `state` may be saved. A state whose last step had a non-finite loss is
        not: its save waits for a finite step (`save_pending`), so that the latest
        checkpoint is always a state that trained finitely. Parameters that are not finite
        never recover (a skipped step keeps them) and stop the run, as does a phase whose
        last step cannot wait."""
        nonfinite = int(jax.device_get(state.consecutive_nonfinite))
        if not params_finite(state.params):
            raise TrainingStopped(
                f"phase {self.phase.name}: the parameters after step {step} are not finite "
                f"(the update diverged); not saved, {self.last_checkpoint()}"
            )
        if not nonfinite:
            return True
        if step >= self.num_steps:
            raise TrainingStopped(
                f"phase {self.phase.name}: its last {nonfinite} steps (to {step}) had a "
                f"non-finite loss or gradient; not saved, {self.last_checkpoint()}"
            )
        logging.warning(
            "Phase %s step %d: not saved, the last %d steps had a non-finite loss; the save "
            "waits for a finite step",
            self.phase.name,
            step,
            nonfinite,
        )
        self.save_pending = True
        return False

    def last_checkpoint(self) -> str:
        """Where the run stands after a divergence, for its one line."""
        saved = self.ckpt.steps()
        where = checkpointing.checkpoint_dir(self.workdir, self.phase.name)
        if not saved:
            return f"no checkpoint of phase {self.phase.name} was saved (a lower learning rate?)"
        return f"the last checkpoint, {where}/{max(saved)}, is kept (a lower learning rate?)"


class Profile:
    """A hook of the loop (`config.profile`): the JAX profiler traces the `num_steps` steps
    after step `first` into `logdir` (plugins/profile/RUN/*.xplane.pb, which TensorBoard's
    profile plugin and XProf open)."""

    def __init__(self, logdir: str, first: int, num_steps: int = 5):
        self.logdir, self.first, self.last = logdir, first, first + num_steps
        self.running = False

    def __call__(self, step: int) -> None:
        """Called after `step`."""
        if step == self.first:
            jax.profiler.start_trace(self.logdir)
            self.running = True
        elif step >= self.last:
            self.stop()

    def stop(self) -> None:
        if self.running:
            jax.profiler.stop_trace()
            self.running = False


def check_nonfinite(state, step: int, limit: int) -> None:
    consecutive = int(jax.device_get(state.consecutive_nonfinite))
    if consecutive >= limit:
        raise TrainingStopped(
            f"{consecutive} consecutive steps ({step - consecutive + 1}..{step}) had a "
            f"non-finite loss or gradient and were skipped (limit: "
            f"max_consecutive_nonfinite_steps={limit})"
        )


def params_finite(params) -> bool:
    """Whether every parameter is finite: one program (not one per tensor, each with its
    own collectives), one transfer."""
    return bool(jax.device_get(_all_finite(params)))


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def log_summary(workdir: str, results: list[PhaseResult]) -> None:
    """A few lines at the end: each phase's steps, time and final evaluation; where to look."""
    if jax.process_index() == 0:
        phases_run = [(r.name, r.step, r.seconds, r.eval_metrics) for r in results]
        checkpoints = checkpointing.checkpoint_dir(workdir, "<phase>")
        logging.info("%s", metrics_lib.run_summary(phases_run, workdir, checkpoints))
