"""A workdir belongs to one run (lambjax.train.workdir), and user mistakes end in one line.

The command-line cases run `python -m lambjax.main` as users do; each must end with exit
status 2 and one line naming the value, before any data is built (the data_dir stays empty).
Runs that resume a trained workdir with a changed config are in test_runs.py.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from lambjax import cli
from lambjax.train import checkpointing
from lambjax.train import workdir as workdir_lib
from lambjax.train.config import base_config, phase_config, with_phases
from tests.helpers import REPO, run


def config(**phase1):
    return with_phases(
        base_config(),
        phase1=phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=32,
            num_steps=phase1.pop("num_steps", 100),
            learning_rate=phase1.pop("learning_rate", 1e-2),
        ),
        phase2=phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=8,
            num_steps=10,
            learning_rate=5e-3,
        ),
    )


def as_json(config):
    return json.loads(config.to_json_best_effort())


def test_resumable_fields_are_accepted_and_logged():
    old, new = config(), config(num_steps=200)
    new.log_every_steps = 1
    new.mesh.fsdp = 2
    new.checkpoint_every_steps = 50
    differences, accepted = workdir_lib.compare(as_json(old), as_json(new), ["phase1"])
    assert differences == []
    assert accepted == [
        "checkpoint_every_steps: 100 in the workdir, 50 now",
        "log_every_steps: 10 in the workdir, 1 now",
        "mesh.fsdp: 1 in the workdir, 2 now",
        "phases.phase1.num_steps: 100 in the workdir, 200 now",
    ]


def test_other_fields_end_the_start_one_line_each():
    old, new = config(), config(learning_rate=2e-2)
    new.model.preset = "mini"
    new.seed = 1
    differences, _ = workdir_lib.compare(as_json(old), as_json(new), ["phase1"])
    assert differences == [
        'model.preset: "tiny" in the workdir, "mini" now',
        "phases.phase1.learning_rate: 0.01 in the workdir, 0.02 now",
        "seed: 0 in the workdir, 1 now",
    ]


def test_a_phase_without_checkpoints_may_still_change():
    old, new = config(), config()
    new.phases.phase2.learning_rate = 1e-3
    new.phases.phase2.optimizer.name = "lans"
    differences, accepted = workdir_lib.compare(as_json(old), as_json(new), ["phase1"])
    assert differences == [] and len(accepted) == 2
    differences, _ = workdir_lib.compare(as_json(old), as_json(new), ["phase1", "phase2"])
    assert len(differences) == 2


def test_phase_order_may_grow_but_not_move_a_started_phase():
    old = config()
    grown = config()
    grown.phases.phase3 = phase_config(
        max_seq_length=512,
        max_predictions_per_seq=80,
        global_batch_size=8,
        num_steps=10,
        learning_rate=1e-3,
    )
    grown.phase_order = ("phase1", "phase2", "phase3")
    differences, _ = workdir_lib.compare(as_json(old), as_json(grown), ["phase1"])
    assert differences == []
    swapped = config()
    swapped.phase_order = ("phase2", "phase1")
    differences, _ = workdir_lib.compare(as_json(old), as_json(swapped), ["phase1"])
    assert differences == [
        'phase_order: ["phase1", "phase2"] in the workdir, ["phase2", "phase1"] now'
    ]


def test_saved_config_round_trips_and_a_damaged_one_is_named(tmp_path):
    workdir = str(tmp_path)
    assert workdir_lib.saved_config(workdir) is None
    workdir_lib.save_config(config().to_json_best_effort(), workdir)
    assert workdir_lib.saved_config(workdir) == as_json(config())
    # A later phase's first checkpoint:
    workdir_lib.save_config(config(num_steps=5).to_json_best_effort(), workdir)
    assert workdir_lib.saved_config(workdir)["phases"]["phase1"]["num_steps"] == 5
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(workdir_lib.WorkdirError, match="config.json cannot be read"):
        workdir_lib.saved_config(workdir)


def test_a_checkpoint_that_reads_but_does_not_fit_stays_where_it_is(tmp_path):
    state = {"params": {"kernel": jnp.ones((4, 8))}, "step": jnp.zeros((), jnp.int32)}
    ckpt = checkpointing.PhaseCheckpoints(str(tmp_path), "phase1", max_to_keep=3, async_save=False)
    ckpt.save(10, state, {"position": 1}, {"phase": "phase1"})
    other = jax.eval_shape(lambda: {**state, "params": {"kernel": jnp.ones((4, 16))}})
    with pytest.raises(checkpointing.CheckpointMismatch, match=r"params/kernel is \(4, 8\) there"):
        ckpt.restore_latest(other)
    assert ckpt.steps() == [10]
    assert not (tmp_path / "checkpoints" / "phase1.unreadable").exists()
    restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
    assert restored.step == 10
    ckpt.close()


def main(tmp_path, *flags):
    """`python -m lambjax.main` with the demo config and a fresh data_dir; returns the result."""
    data_dir = tmp_path / "data"
    args = [sys.executable, "-m", "lambjax.main", *flags]
    if not any(f.startswith("--config=") for f in flags):
        args.append("--config=configs/default.py")
    args.append(f"--config.data.data_dir={data_dir}")
    if not any(f.startswith("--workdir") for f in flags):
        args.append(f"--workdir={tmp_path / 'run'}")
    result = run(args, 1, check=False, timeout=120)
    assert not data_dir.exists(), "data was built before the error"
    return result


FLAG_MISTAKES = [
    (
        ["--config.phases.phase1.nmu_steps=3"],
        "--config.phases.phase1.nmu_steps: config.phases.phase1 (configs/default.py) has "
        "no field 'nmu_steps'; did you mean num_steps?",
    ),
    (
        ["--config.phases.phase1.num_steps=3.5"],
        "--config.phases.phase1.num_steps=3.5: config.phases.phase1.num_steps takes an "
        "integer (the config gives 300)",
    ),
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such config file"),
    (
        ["--config=configs/bert_lamb.py:huge"],
        "--config=configs/bert_lamb.py:huge: config argument 'huge'",
    ),
    (["--config.profile=maybe"], "--config.profile=maybe: config.profile takes true or false"),
    (
        ["--config.modl.preset=mini"],
        "--config.modl.preset: the config (configs/default.py) "
        "has no field 'modl'; did you mean model?",
    ),
    (["--config.seed.x=1"], "--config.seed.x: config.seed is a value"),
]


@pytest.mark.parametrize("flags, message", FLAG_MISTAKES)
def test_flag_mistakes_are_named(flags, message, monkeypatch):
    monkeypatch.chdir(REPO)
    args = (
        flags
        if any(f.startswith("--config=") for f in flags)
        else ["--config=configs/default.py", *flags]
    )
    with pytest.raises(ValueError) as error:
        cli.check_config_flags(args)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("flags, message", FLAG_MISTAKES[:3])
def test_flag_mistakes_end_the_command_with_one_line(tmp_path, flags, message):
    result = main(tmp_path, *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == f"lambjax: error: {result.stderr.split(': error: ', 1)[1]}"
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        f"lambjax: error: {message}"
    ), result.stderr


def test_workdir_mistakes_are_named(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{")
    for workdir, message in (
        (a_file, f"--workdir={a_file} is a file"),
        (a_file / "run", f"--workdir={a_file / 'run'} cannot be created or written"),
        ("/proc/lambjax-run", "--workdir=/proc/lambjax-run cannot be created or written"),
        (damaged, f"{damaged / 'config.json'} cannot be read"),
    ):
        with pytest.raises(workdir_lib.WorkdirError) as error:
            workdir_lib.check(config().to_json_best_effort(), str(workdir))
        assert str(error.value).startswith(message)
    assert a_file.read_text() == "not a directory"
    assert os.listdir(damaged) == ["config.json"]


@pytest.mark.slow
def test_workdir_mistakes_end_the_command_before_any_data_build(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{")
    for workdir, message in (
        (a_file, f"--workdir={a_file} is a file"),
        (a_file / "run", f"--workdir={a_file}/run cannot be created"),
        (damaged, f"{damaged}/config.json cannot be read"),
    ):
        result = main(tmp_path, f"--workdir={workdir}")
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"lambjax: error: {message}"), result.stderr[-2000:]
        assert "Traceback" not in result.stderr
