"""Model FLOPs against a count of the traced matmuls, and the throughput meter."""

import dataclasses

import jax
import numpy as np
import pytest

from lambjax.models import pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import throughput
from tests.helpers import dot_flops, random_batch

CONFIG = BertConfig.preset("tiny", vocab_size=64, num_layers=3, dtype="float32")


def test_train_step_flops_match_a_count_of_the_traced_matmuls():
    config = dataclasses.replace(CONFIG, scan_layers=False)
    params = init_params(config, jax.random.key(0))
    x = random_batch(0, batch=2, seq=12, predictions=3, vocab_size=config.vocab_size)

    def loss(p):
        return pretraining.pretraining_stats(config, p, x)["mlm_loss_sum"]

    forward = dot_flops(jax.make_jaxpr(loss)(params).jaxpr)
    train = dot_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert throughput.forward_flops(config, 2, 12, 3) == forward
    # The backward of the first matmul of each chain also computes an (unused) input
    # gradient, so the traced count is at most the formula's 3x.
    assert throughput.train_step_flops(config, 2, 12, 3) == 3 * forward
    assert 2.5 * forward < train <= 3 * forward


def test_throughput_over_the_steps_since_the_last_measurement(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now[0])
    meter = throughput.Throughput(tokens_per_step=1000, flops_per_step=4e12, peak_flops=1e12)
    assert meter.measure(0) == {}  # starts the clock (this window holds the compilation)
    now[0] = 110.0
    first = meter.measure(5)  # 5 steps in 10 s
    assert first["step_time_s"] == pytest.approx(2.0)
    assert first["tokens_per_s"] == pytest.approx(500.0)
    assert first["mfu"] == pytest.approx(2.0)  # 2e12 FLOP/s against a 1e12 peak
    now[0] = 130.0
    second = meter.measure(15)  # 10 steps in 20 s
    assert second["flops_per_s"] == pytest.approx(2e12)
    meter.reset(15)  # e.g. after an evaluation: its time is not a step's
    now[0] = 200.0
    assert meter.measure(16)["step_time_s"] == pytest.approx(70.0)
    unknown_peak = throughput.Throughput(tokens_per_step=1, flops_per_step=1, peak_flops=None)
    unknown_peak.measure(0)
    now[0] = 201.0
    assert "mfu" not in unknown_peak.measure(1)


def test_peak_flops_by_device_kind():
    assert throughput.peak_flops_per_device(123.0) == 123.0  # configured wins
    assert throughput.peak_flops_per_device(0.0) is None  # a CPU has no data-sheet peak
    assert np.isclose(throughput.PEAK_FLOPS_BY_DEVICE_KIND["NVIDIA H100"], 989e12)
