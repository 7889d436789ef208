"""lambjax.contrib.variance_retention: the derived prediction against hand-computed values, its
limits, and the emulation it predicts (Sakr et al. 2019, arXiv 1901.06588)."""

import pytest

from lambjax.contrib import variance_retention as vrr

# The standard normal CDF at the points the hand computations need (printed tables).
PHI = {
    0.5: 0.691462,
    1.0: 0.841345,
    1.5: 0.933193,
    2.0: 0.977250,
    2.5: 0.993790,
    3.0: 0.998650,
    3.5: 0.999767,
    4.0: 0.999968,
    4.5: 0.999997,
    5.0: 1.0,
    5.5: 1.0,
    6.0: 1.0,
}


def test_the_power_a_rounded_gaussian_keeps_matches_the_hand_computed_sums():
    # g(t) = sum_k (k t)^2 * 2 [Phi((k + 1/2) t) - Phi((k - 1/2) t)], by hand from the table:
    # t = 2: 4 * 2 (Phi(3) - Phi(1)) + 16 * 2 (Phi(5) - Phi(3)) = 1.30164;
    # t = 4: 16 * 2 (Phi(6) - Phi(2)) + ... = 0.72800 (most of the term is swamped).
    g2 = 4 * 2 * (PHI[3.0] - PHI[1.0]) + 16 * 2 * (PHI[5.0] - PHI[3.0])
    g4 = 16 * 2 * (PHI[6.0] - PHI[2.0])
    assert g2 == pytest.approx(1.30164, abs=1e-5)
    assert vrr.rounded_power([2.0, 4.0]) == pytest.approx([g2, g4], abs=2e-5)
    # At t = 1 the sum is Sheppard's 1 + 1/12 (to the table's rounding); below it that
    # form is used.
    g1 = sum(k * k * 2 * (PHI[k + 0.5] - PHI[k - 0.5]) for k in (1.0, 2.0, 3.0, 4.0, 5.0))
    assert g1 == pytest.approx(1 + 1 / 12, abs=5e-5)
    assert vrr.rounded_power([0.5, 1.0]) == pytest.approx([1 + 0.25 / 12, 1 + 1 / 12])


def test_the_pull_at_a_binade_boundary_matches_its_hand_computed_terms():
    # h(0) for a fine grid of one sigma: Phi(1.5) - 2 Phi(1) + Phi(0.5) = -0.058035.
    h0 = PHI[1.5] - 2 * PHI[1.0] + PHI[0.5]
    assert vrr._second_difference(0.0, 1.0, 1.0) == pytest.approx(h0, abs=2e-6)
    # Grids far finer than the terms: the sums tend to f^2 / 8, and meet it at the switch.
    assert vrr.boundary_pull(1 / 255, 1.0) == pytest.approx((1 / 255) ** 2 / 8, rel=2e-3)
    assert vrr.boundary_pull(1 / 300, 1.0) == (1 / 300) ** 2 / 8
    # The pull scales with the grid: f and sigma doubled together give 4x.
    assert vrr.boundary_pull(2.0, 2.0) == pytest.approx(4 * vrr.boundary_pull(1.0, 1.0))


def test_the_prediction_has_the_right_limits():
    assert vrr.predicted_vrr(1, 2) == 1.0  # one term is exact
    assert vrr.predicted_vrr(4096, 23) == pytest.approx(1.0, abs=1e-4)  # float32's mantissa
    # Fewer mantissa bits keep less, and chunks keep more than one long sum.
    naive = [vrr.predicted_vrr(4096, m) for m in (3, 5, 7)]
    assert naive[0] < naive[1] < naive[2]
    assert vrr.predicted_vrr(4096, 3, 64) > naive[0] + 0.3
    # Chunked = the inner sums' ratio times the outer sum's, by construction.
    inner = vrr.predicted_vrr(64, 4)
    outer = vrr._naive(64, 4, sigma=(64 * inner) ** 0.5)
    assert vrr.predicted_vrr(4096, 4, 64) == pytest.approx(inner * outer)
    with pytest.raises(ValueError, match="chunk_size=48 must be a positive divisor of n=4096"):
        vrr.predicted_vrr(4096, 4, 48)


@pytest.mark.parametrize("mantissa_bits, chunk_size", [(2, None), (8, None), (2, 32)])
def test_the_prediction_follows_the_emulated_sums(mantissa_bits, chunk_size):
    # 1,024 sums of 2,048 N(0, 1) terms in e6mM, emulated by lambjax.contrib.precision. Within 0.1:
    # the prediction is a model (Gaussian running sums), not the paper's equation. Measured
    # / predicted: 2 bits naive 0.101 / 0.072, chunks of 32 0.692 / 0.774; 8 bits 1.000 /
    # 0.999.
    measured = vrr.measured_vrr(2048, mantissa_bits, chunk_size, sums=1024)
    predicted = vrr.predicted_vrr(2048, mantissa_bits, chunk_size)
    assert predicted == pytest.approx(measured, abs=0.1)
