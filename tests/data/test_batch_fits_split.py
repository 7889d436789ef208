"""Data that cannot fill a batch stops the start in one line naming the numbers (after the
data is built, before anything is compiled), and the training iterator never ends: an epoch
that is used up starts the next one."""

import os

import pytest

from lambjax import cli, data
from lambjax.train import phases
from lambjax.train import plan as plan_lib
from tests import helpers
from tests.data.test_data import _documents, config


def demo_plan(**changes):
    config_ = cli.load_config(os.path.join(helpers.REPO, "configs/default.py"))
    for field, value in changes.items():
        group, _, name = field.rpartition(".")
        node = config_
        for part in filter(None, group.split(".")):
            node = node[part]
        node[name] = value
    return plan_lib.resolve(config_, vocab_size=4096, num_devices=1)


def datasets(train: int, validation: int, seq_lengths=(128, 512)):
    """Stand-ins for the built datasets: splits of `train` and `validation` examples."""
    splits = {"train": range(train), "validation": range(validation)}
    return {seq: data.Prepared(splits, "", 0, {}, (), seq, {}) for seq in seq_lengths}


@pytest.mark.parametrize(
    "changes, train, validation, message",
    [
        (
            {"phases.phase1.global_batch_size": 1024},
            989,
            52,
            "config.phases.phase1.global_batch_size=1024 exceeds the 989 training examples "
            "config.data.source=embedded yields at max_seq_length=128; valid: at most 989",
        ),
        ({}, 0, 0, "yields no training examples at max_seq_length=128 (no sentence pairs)"),
        (
            {"eval_batch_size": 64},
            989,
            52,
            "config.eval_batch_size=64 exceeds the 52 held-out examples",
        ),
    ],
)
def test_a_batch_larger_than_its_split_is_refused(changes, train, validation, message):
    with pytest.raises(data.DataError) as error:
        phases.check_data(demo_plan(**changes), datasets(train, validation))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_batches_that_fit_pass_and_no_held_out_split_is_no_evaluation():
    phases.check_data(demo_plan(), datasets(989, 52))
    phases.check_data(demo_plan(**{"data.validation_fraction": 0.0}), datasets(989, 0))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A text corpus of 30 short documents, built at max_seq_length 64."""
    root = tmp_path_factory.mktemp("small")
    (root / "corpus.txt").write_text(_documents(30))
    c = config(root / "out", source=f"text:{root}/corpus.txt", vocab_size=200)
    return data.prepare(c, 64, beam_options="direct_num_workers=1")


def test_the_training_iterator_starts_the_next_epoch(small):
    examples = small.num_examples("train")
    batch = examples // 2  # two batches an epoch
    iterator = data.make_iterator(
        small, split="train", global_batch_size=batch, max_predictions_per_seq=8, seed=0
    )
    assert iterator.batches_per_epoch == 2
    for _ in range(7):  # three epochs and a half
        assert next(iterator)["input_ids"].shape == (batch, 64)


def test_an_endless_iterator_over_no_batch_is_refused(small):
    examples = small.num_examples("train")
    with pytest.raises(data.DataError, match=f"has {examples} examples, fewer than one global"):
        data.make_iterator(
            small, split="train", global_batch_size=examples + 1, max_predictions_per_seq=8, seed=0
        )
    # One pass (evaluation) over too few examples is simply empty.
    once = data.make_iterator(
        small,
        split="train",
        global_batch_size=examples + 1,
        max_predictions_per_seq=8,
        seed=0,
        num_epochs=1,
    )
    assert list(once) == []


@pytest.mark.slow
def test_a_single_document_corpus_stops_the_start_in_one_line(tmp_path):
    (tmp_path / "one.txt").write_text(_documents(1))
    result = helpers.run(
        helpers.lambjax_main(
            "--config=configs/default.py:runlocal",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data.source=text:{tmp_path / 'one.txt'}",
            "--config.data.vocab_size=200",
        ),
        1,
        check=False,
    )
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "training examples" in errors[0] and "max_seq_length=128" in errors[0]
    assert "Traceback" not in result.stderr and "StopIteration" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
