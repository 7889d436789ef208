"""A 3-trial sweep over the demo's runlocal config, for the sweep tests."""

from configs import default
from lambjax.sweep import spec


def get_config(arg=None):
    return default.get_config("runlocal")


def get_sweep(arg=None):
    if arg == "empty":
        return []
    if arg == "typo":
        return [{"phases.phase1.learning_rat": 1e-2}]
    if arg == "type":
        return [{"phases.phase1.num_steps": 2.5}]
    if arg == "twice":
        return [{"seed": 1}, {"seed": 1}]
    # Fields that leave the compiled steps as they are: the trials share one compilation
    # (tests' persistent compilation cache). The learning rate would not (its schedule is
    # part of the step).
    trials = spec.zipped({"seed": [0, 1, 2], "data.masked_lm_prob": [0.15, 0.2, 0.1]})
    return trials[:2] if arg == "two" else trials
