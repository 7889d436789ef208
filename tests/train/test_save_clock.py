"""Checkpoints by wall time (lambjax.train.checkpointing.SaveClock) on a hand-driven clock;
a whole run that saves by time and resumes from such a save is in tests/train/test_runs.py."""

import pytest

from lambjax.train import checkpointing, plan
from lambjax.train import config as config_lib


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_due_after_the_interval_at_log_steps_only_and_again_after_each_save():
    clock = Clock()
    saves = checkpointing.SaveClock(every_minutes=2, check_every_steps=5, clock=clock)
    clock.now += 119
    assert not saves.due(5)  # 1 s short of two minutes
    clock.now += 1
    assert not saves.due(7)  # not a log step: the clock is not read
    assert saves.due(10)
    saves.saved()
    clock.now += 60
    assert not saves.due(15)  # the interval starts at the last save, whatever caused it
    clock.now += 60
    assert saves.due(20)


def test_zero_minutes_never_saves_by_time():
    clock = Clock()
    saves = checkpointing.SaveClock(every_minutes=0, check_every_steps=1, clock=clock)
    clock.now += 10**6
    assert not any(saves.due(step) for step in range(1, 100))


def test_a_negative_interval_is_refused_with_its_value():
    phase1 = config_lib.phase_config(
        max_seq_length=16,
        max_predictions_per_seq=2,
        global_batch_size=8,
        num_steps=2,
        learning_rate=1e-3,
    )
    config = config_lib.with_phases(config_lib.base_config(), phase1=phase1)
    config.checkpoint_every_minutes = -1.0
    with pytest.raises(config_lib.ConfigError, match=r"checkpoint_every_minutes=-1.0 must be >= 0"):
        plan.resolve(config, vocab_size=config.data.vocab_size, num_devices=1)
