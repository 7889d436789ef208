"""The held-out evaluation sees the same masked examples whatever the run's seed, so runs
and a study's seeds compare on one held-out set."""

import types

import pytest

from lambjax.train import trainer


@pytest.mark.parametrize("run_seed", [0, 1, 17])
def test_the_held_out_split_is_masked_with_one_seed_for_every_run(run_seed):
    calls = []

    def batches(split, global_batch_size, seed, **kwargs):
        calls.append((split, global_batch_size, seed, kwargs))
        return iter(())  # no batch: evaluation warns and returns nothing

    loop = types.SimpleNamespace(
        run_plan=types.SimpleNamespace(seed=run_seed, eval_batch_size=8, eval_steps=0),
        phase=types.SimpleNamespace(
            name="phase1",
            prepared=types.SimpleNamespace(data_sources={"train": None, "validation": None}),
            batches=batches,
        ),
    )
    assert trainer.PhaseLoop.evaluation(loop, params=None) == {}
    assert calls == [
        ("validation", 8, trainer.HELD_OUT_SEED, {"num_epochs": 1, "pad_last_batch": True})
    ]
