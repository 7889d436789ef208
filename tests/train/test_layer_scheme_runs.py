"""End-to-end runs of the `mslt` and `pld` variants of the demo config (as subprocesses).

`configs/default.py:mslt,runlocal` has the stages phase1_stage1 (1 layer), phase1_stage2
(2 layers, the bottom one frozen) and phase2 (both layers trained), 3 + 3 + 6 steps.
"""

import os
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import helpers
from tests.helpers import REPO, environment, lambjax_main, losses, wait_for_checkpoint

pytestmark = pytest.mark.slow  # end-to-end runs, each over ~10 s

DEVICES = 2
STAGES = {"phase1_stage1": 3, "phase1_stage2": 3, "phase2": 6}


def command(workdir, data_dir, variant):
    return lambjax_main(
        f"--config=configs/default.py:{variant},runlocal",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        "--config.checkpoint_every_steps=2",
        "--config.log_every_steps=1",
    )


def run(workdir, data_dir, variant):
    helpers.run(command(workdir, data_dir, variant), DEVICES)


def layers(workdir, phase, step):
    path = os.path.join(workdir, "checkpoints", phase, str(step), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    args = ocp.args.PyTreeRestore(
        restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    )
    return checkpointer.restore(path, args=args)["params"]["encoder"]["layers"]


def leaves(tree):
    return ocp.tree.to_flat_dict(tree)


@pytest.fixture(scope="module")
def mslt_run(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("mslt"))
    run(workdir, data_dir, "mslt")
    return workdir


def test_stages_grow_the_encoder_and_freeze_the_layers_below(mslt_run):
    for phase, steps in STAGES.items():
        assert os.path.isdir(os.path.join(mslt_run, "checkpoints", phase, str(steps))), phase
    stage1 = leaves(layers(mslt_run, "phase1_stage1", 3))
    stage2 = leaves(layers(mslt_run, "phase1_stage2", 3))
    final = leaves(layers(mslt_run, "phase2", 6))
    for name, value in stage1.items():
        assert value.shape[0] == 1 and stage2[name].shape[0] == 2
        # Stage 2 ran layer 0 forward only: bit-identical to where stage 1 left it.
        np.testing.assert_array_equal(stage2[name][0], value[0])
    # Stage 2 trained its new top layer, and phase 2 trains both again.
    assert any(not np.array_equal(stage2[n][1], v[0]) for n, v in stage1.items())
    assert any(not np.array_equal(final[n][0], v[0]) for n, v in stage2.items())
    logged = losses(mslt_run)
    assert sorted(logged) == list(range(1, sum(STAGES.values()) + 1))
    assert all(np.isfinite(loss) for loss in logged.values())


def test_a_killed_stage_resumes_bitwise(mslt_run, data_dir, tmp_path):
    workdir = str(tmp_path)
    process = subprocess.Popen(
        command(workdir, data_dir, "mslt"),
        cwd=REPO,
        env=environment(DEVICES),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(workdir, "phase1_stage2", 2, process)
    process.kill()
    process.wait()
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "phase2", "6"))
    run(workdir, data_dir, "mslt")
    assert losses(workdir) == losses(mslt_run)


def test_layer_drop_run_drops_layers_as_theta_decays(data_dir, tmp_path):
    workdir = str(tmp_path)
    run(workdir, data_dir, "pld")
    from lambjax.train.metrics import read_jsonl

    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    theta = [r["train/pld_theta"] for _, r in sorted(records.items()) if "train/pld_theta" in r]
    run_layers = [
        r["train/pld_layers_run"] for r in records.values() if "train/pld_layers_run" in r
    ]
    assert len(theta) == 12 and theta[0] == 1.0 and theta == sorted(theta, reverse=True)
    assert theta[-1] == pytest.approx(0.5, abs=1e-3)  # gamma = 100 / 12 steps
    assert min(run_layers) < 2  # some layers were skipped
    assert any("eval/mlm_loss" in r for r in records.values())
