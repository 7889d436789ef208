"""What one held-out evaluation can resolve (studies.held_out): a unigram model's loss on
the masked targets, its per-token spread and the standard error, against numbers by hand."""

import math

import pytest

from studies import held_out


def test_the_unigram_scores_follow_from_the_counts():
    # Counts 3 and 1 over a vocabulary of 2, add-one smoothed: p = 4/6 and 2/6.
    counts = held_out.unigram([1, 1, 1, 2])
    result = held_out.scores(counts, vocab_size=2, targets=[1, 1, 2, 2])
    losses = [-math.log(4 / 6)] * 2 + [-math.log(2 / 6)] * 2
    mean = sum(losses) / 4
    deviation = math.sqrt(sum((x - mean) ** 2 for x in losses) / 3)
    assert result["predictions"] == 4
    assert result["unigram_loss"] == pytest.approx(mean)
    assert result["per_token_sd"] == pytest.approx(deviation)
    assert result["standard_error"] == pytest.approx(deviation / 2)
    assert result["most_frequent_share"] == 0.5
    # A token never seen in training still has a finite loss.
    assert math.isfinite(held_out.scores(counts, 3, [7, 1])["unigram_loss"])
