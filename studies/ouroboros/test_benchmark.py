"""studies/ouroboros/benchmark.py: the schedules' sums on made-up module times, and the XLA flag
its timed processes run with parses in this jaxlib (which stops on an unknown flag)."""

import pytest

from studies.ouroboros import benchmark as ouroboros
from tests.test_xla_flags import run_with_xla_flags

# Forward / backward seconds of one layer, the embeddings, the heads; 6 layers.
PARTS = {"layer": (1.0, 2.0), "embeddings": (0.1, 0.2), "heads": (0.5, 0.7), "num_layers": 6}


def test_the_single_threaded_flag_parses():
    result = run_with_xla_flags(ouroboros.SINGLE_THREADED)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "4.0"


def test_the_schedules_add_up_the_module_times():
    # K = 3 on 2 stages of 3 layers: module 1 = embeddings + 2 layers, module 2 = 3 layers
    # (stage 1), module 3 = 1 layer + heads (stage 0).
    result = ouroboros.schedules(PARTS, 3, 1)
    whole = 0.1 + 0.2 + 6 * 3.0 + 0.5 + 0.7
    assert result["one device"] == (2, pytest.approx(whole))
    forward = [0.1 + 2 * 1.0, 3 * 1.0]
    replay = [0.1 + 2 * 3.0 + 0.2, 3 * 3.0]
    top = 3.0 + 0.5 + 0.7
    # Stage 1 ends its forward at 5.1 and its replay at 14.1; stage 0 replays module 1
    # from 2.1 to 8.4, then runs module 3 from max(8.4, 5.1): 12.6. Stage 1's chain is longer.
    assert result["Ouroboros"] == (3, pytest.approx(sum(forward) + replay[1]))
    # Without overlap: every forward, every replay, module 3, one after another.
    assert result["Ouroboros, no overlap"] == (6, pytest.approx(sum(forward) + sum(replay) + top))
    # Two micro-batches: one device and Ouroboros (micro-batches in turn) take twice as long;
    # GPipe overlaps them.
    twice = ouroboros.schedules(PARTS, 3, 2)
    for name in ("one device", "Ouroboros", "Ouroboros, no overlap"):
        count, seconds = result[name]
        assert twice[name] == (2 * count, pytest.approx(2 * seconds))
    assert twice["GPipe"][1] < 2 * result["GPipe"][1]
