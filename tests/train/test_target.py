"""config.target ends a run at the first evaluation that reaches it (as MLPerf's BERT ends at
a masked-LM accuracy): a checkpoint there, target_reached.json, no later phase; rerunning
does nothing more, and a sweep counts the trial finished (the run itself:
tests/train/test_runs.py, against the reference run)."""

import os

import ml_collections
import pytest

from lambjax import cli
from lambjax.train import config as config_lib
from lambjax.train import loop
from lambjax.train import plan as plan_lib
from lambjax.train import target as target_lib
from tests import helpers


def target(metric, value):
    return ml_collections.ConfigDict({"metric": metric, "value": value})


def test_a_loss_is_reached_at_or_below_and_an_accuracy_at_or_above():
    loss = target_lib.from_config(target("mlm_loss", 4.5))
    assert loss.reached({"mlm_loss": 4.5}) and loss.reached({"mlm_loss": 4.2})
    assert not loss.reached({"mlm_loss": 4.51}) and not loss.reached({"mlm_loss": float("nan")})
    assert not loss.reached({"mlm_accuracy": 0.9})
    accuracy = target_lib.from_config(target("mlm_accuracy", 0.72))
    assert accuracy.reached({"mlm_accuracy": 0.72}) and not accuracy.reached({"mlm_accuracy": 0.7})
    assert str(accuracy) == "eval mlm_accuracy >= 0.72"
    assert target_lib.from_config(target("", 0.0)) is None


@pytest.mark.parametrize(
    "metric, value, message",
    [
        (
            "loss",
            1.0,
            "config.target.metric='loss' is not a held-out metric with a target; "
            "valid: mlm_loss, mlm_accuracy, nsp_accuracy",
        ),
        ("mlm_loss", float("nan"), "config.target.value=nan must be a finite number"),
        ("mlm_loss", -1.0, "config.target.value=-1.0 must be > 0 for mlm_loss"),
        ("mlm_accuracy", 72.0, r"config.target.value=72.0 must lie in \(0, 1\] for mlm_accuracy"),
    ],
)
def test_the_plan_refuses_a_target_it_could_not_reach(metric, value, message):
    config = cli.load_config(os.path.join(helpers.REPO, "configs/default.py"))
    config.target = target(metric, value)
    with pytest.raises(config_lib.ConfigError, match=message):
        plan_lib.resolve(config, num_devices=1)


class CountingJob:
    """A job of the shared loop whose evaluation reaches its target at step `reach`."""

    def __init__(self, reach):
        self.num_steps, self.reach, self.saved = 10, reach, []
        self.intervals = loop.Intervals(1, 2, 100, eval_after_last_step=True)
        self.steps = loop.CompiledSteps(
            init_state=None,
            init_optimizer=None,
            train=lambda state, batch, rng: (state + 1, {}),
            eval=None,
        )
        self.rng = None

    def batch(self, step):
        return {}

    def log(self, step, state, means):
        pass

    def evaluate(self, step, state):
        return step >= self.reach

    def save(self, step, state):
        self.saved.append(step)

    def save_due(self, step):
        return False


class NeverStops:
    def requested(self, step):
        return False


def test_the_loop_saves_and_ends_at_the_evaluation_that_reaches_the_target():
    job = CountingJob(reach=5)
    state, step, stopped = loop.run_job(job, 0, 0, NeverStops())
    assert (state, step, stopped) == (6, 6, False)  # evaluations at 2, 4, 6: 6 reaches it
    assert job.saved == [6]
    job = CountingJob(reach=99)
    assert loop.run_job(job, 0, 0, NeverStops())[1] == 10 and job.saved == [10]
