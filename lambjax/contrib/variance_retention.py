"""How much of a sum's variance a low-precision accumulator keeps: `predicted_vrr(n,
mantissa_bits, chunk_size)`, and `measured_vrr` from lambjax.contrib.precision's emulation.

Sakr et al. ("Accumulation Bit-Width Scaling for Ultra-Low Precision Training of Deep
Networks", ICLR 2019, arXiv 1901.06588) measure a narrow accumulator by the variance
retention ratio, VRR = Var(computed sum) / Var(exact sum) over an ensemble of dot products:
small addends swamped by a large running sum are lost, and with them variance. Their
closed form (full and partial swamping, chunking, sparsity) could not be read here: only the
paper's abstract and introduction were available, so the equation below is derived in this
module from the setting their abstract states, not copied, and carries no equation number
of theirs. The assumptions:

- the n terms p_i are independent, zero-mean Gaussians of one standard deviation sigma
  (products of independent zero-mean operands are zero-mean; the paper's ensemble view);
- the running sum s_{i-1} before term i is a zero-mean Gaussian whose variance is what the
  terms before it contributed, as computed (so the prediction is self-consistent: lost
  variance makes later swamping weaker);
- adding p_i to s_{i-1} in an accumulator of m stored mantissa bits rounds the sum to the
  nearest value of the format, whose spacing is u = 2^(e - m) in the binade [2^e, 2^(e+1))
  (no exponent range limit). Inside a binade the kept increment is u * round(p_i / u):
  round(p/u) = 0 is full swamping, the other values partial swamping;
- the running sum sits on the format's grid, and its increments, given the past, are
  symmetric about zero except next to a binade boundary.

The variance of the computed sum then grows, step by step, by the power of the kept
increment plus twice its covariance with the sum:

    v_0 = 0,  v_1 = sigma^2,
    v_i = v_{i-1} + sigma^2 E_{s ~ N(0, v_{i-1})}[ g(ulp(s) / sigma) ]
                  - 2 sum_e 2^e rho(2^e) S(2^(e-1-m)),
    VRR_naive(n, m) = v_n / (n sigma^2).

g(t) = E[(t * round(Z / t))^2], Z standard normal, is the power a Gaussian term keeps when
rounded to a grid of step t sigma (1 + t^2 / 12 for t <= 1, Sheppard's correction, accurate
there to better than 1e-8; the sum over grid points otherwise); the expectation over s runs
over its binades, P(2^e <= |s| < 2^(e+1)) = 2 (Phi(2^(e+1) / sqrt(v)) - Phi(2^e / sqrt(v))).
g > 1 for fine grids: a term rounded but not swamped gains the rounding noise's variance,
so the ratio can exceed 1 a little, as measured sums do.

The second term is stagnation. At a boundary B = 2^e the grid is f = 2^(e-1-m) below and 2f
above, and rounding there is not symmetric: a sum just above B that steps down is rounded
on the finer grid, one that steps up on the coarser one, so small steps toward zero survive
where small steps away from it are swamped. For the grid point s at distance D from B (on
either side) the mean increment is -sum_k |h(D + 2 k f)|, with

    h(D) = f [Phi((D + 3f/2) / sigma) - 2 Phi((D + f) / sigma) + Phi((D + f/2) / sigma)],

and S(f) sums these pulls over the grid points next to the boundary, each weighted by its
spacing (2f above B, f below). Times B and rho(B), the density of |s| at B (half-normal,
variance v), it is -E[s * increment] at that boundary. S(f) -> f^2 / 8 for f << sigma.
Without this term the model keeps every increment's power and predicts no stagnation; a
1-5-4 sum of 8,192 unit Gaussians keeps 0.27 of its variance by it and 0.36 measured, 0.97
without it.

Chunk-based accumulation of n = c * k terms in chunks of c: each chunk sum is a naive sum of
c terms, and the k chunk sums (Gaussians of variance c sigma^2 VRR_naive(c, m)) are summed
naively again, so

    VRR_chunked(n, m, c) = VRR_naive(c, m) * VRR_naive(k, m) (outer terms of that sigma).
"""

import math

import numpy as np
from scipy.special import ndtr  # the standard normal CDF (scipy comes with jax)

_BINADES_BELOW, _BINADES_ABOVE = 40, 8  # around the sum's standard deviation


def rounded_power(t) -> np.ndarray:
    """g(t) = E[(t * round(Z / t))^2] for Z ~ N(0, 1): the power a unit Gaussian keeps when
    rounded to nearest on a grid of step t (1 + t^2/12 for t <= 1)."""
    t = np.asarray(t, np.float64)
    result = 1 + t**2 / 12
    coarse = t > 1
    if np.any(coarse):
        tc = t[coarse][:, None]
        k = np.arange(1, int(np.ceil(10 / tc.min())) + 2)[None, :]
        mass = ndtr((k + 0.5) * tc) - ndtr((k - 0.5) * tc)
        result[coarse] = np.sum(2 * (k * tc) ** 2 * mass, axis=1)
    return result


def _second_difference(distance, fine: float, sigma: float) -> np.ndarray:
    """h(D) = f [Phi((D + 3f/2)/sigma) - 2 Phi((D + f)/sigma) + Phi((D + f/2)/sigma)]: the
    mean change a binade boundary makes to the increment of a sum that stands D from it."""
    z = np.asarray(distance, np.float64) / sigma
    step = fine / sigma
    return fine * (ndtr(z + 1.5 * step) - 2 * ndtr(z + step) + ndtr(z + 0.5 * step))


def boundary_pull(fine: float, sigma: float) -> float:
    """S(f): the sum, over the grid points s next to one binade boundary B (grid f below B,
    2f above), of the grid spacing times |E[increment | s]|, the pull toward zero. Times
    B and the density of |s| at B it is one boundary's -E[s * increment]."""
    if fine < sigma / 256:  # the smooth limit of the sums below
        return fine**2 / 8
    count = int(np.ceil(12 * sigma / fine)) + 2
    r = np.arange(count)
    # Above B: points B + j 2f (j >= 0), each pulled by h at distances (j + k) 2f, k >= 0.
    above = 2 * fine * np.sum((r + 1) * np.abs(_second_difference(r * 2 * fine, fine, sigma)))
    # Below B: points B - j f (j >= 1), pulled by h at distances j f + k 2f.
    below_pairs = (r[1:] - 1) // 2 + 1  # the (j, k) with j + 2k = r
    below = fine * np.sum(below_pairs * np.abs(_second_difference(r[1:] * fine, fine, sigma)))
    return float(above + below)


def _naive(n: int, mantissa_bits: int, sigma: float) -> float:
    """VRR of n N(0, sigma^2) terms summed one after another (the module docstring)."""
    variance = 0.0
    pulls = {}
    for _ in range(n):
        if variance == 0.0:
            variance = sigma**2  # the first term enters exactly
            continue
        std = math.sqrt(variance)
        top = math.floor(math.log2(std))
        exponents = np.arange(top - _BINADES_BELOW, top + _BINADES_ABOVE)
        lower, upper = np.exp2(exponents) / std, np.exp2(exponents + 1) / std
        mass = 2 * (ndtr(upper) - ndtr(lower))
        below = 2 * (ndtr(lower[0]) - 0.5)  # |s| below the lowest binade: an exact add
        power = np.sum(mass * rounded_power(np.exp2(exponents - mantissa_bits) / sigma))
        # The pull toward zero at each boundary 2^e: 2 E[s * increment] < 0.
        density = 2 * np.exp(-0.5 * lower**2) / (math.sqrt(2 * math.pi) * std)  # of |s|
        for e in exponents:
            if e not in pulls:
                pulls[e] = boundary_pull(2.0 ** (e - 1 - mantissa_bits), sigma)
        pull = np.sum(np.exp2(exponents) * density * np.array([pulls[e] for e in exponents]))
        variance = max(variance + sigma**2 * (power + below) - 2 * pull, 0.0)
    return variance / (n * sigma**2)


def predicted_vrr(n: int, mantissa_bits: int, chunk_size: int | None = None, sigma=1.0):
    """The variance retention ratio of summing n zero-mean Gaussian terms of standard
    deviation `sigma` in an accumulator of `mantissa_bits` stored mantissa bits, naively
    (chunk_size None or >= n) or in chunks of `chunk_size` (which must divide n); the
    derivation and its assumptions are in the module docstring."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"predicted_vrr: n={n!r} must be a positive integer")
    if not isinstance(mantissa_bits, int) or mantissa_bits < 0:
        raise ValueError(f"predicted_vrr: mantissa_bits={mantissa_bits!r} must be >= 0")
    if chunk_size is None or chunk_size >= n:
        return _naive(n, mantissa_bits, sigma)
    if chunk_size < 1 or n % chunk_size:
        raise ValueError(
            f"predicted_vrr: chunk_size={chunk_size} must be a positive divisor of n={n}"
        )
    inner = _naive(chunk_size, mantissa_bits, sigma)
    chunk_sigma = sigma * math.sqrt(chunk_size * inner)
    return inner * _naive(n // chunk_size, mantissa_bits, chunk_sigma)


def measured_vrr(
    n: int, mantissa_bits: int, chunk_size: int | None, *, sums: int, exponent_bits=6, seed=0
) -> float:
    """The ratio measured with lambjax.contrib.precision.chunked_dot: `sums` independent sums of n
    N(0, 1) terms (a [sums, n] Gaussian matrix times ones), accumulated in the format
    e{exponent_bits}m{mantissa_bits}, against the same sums in float64."""
    import jax
    import jax.numpy as jnp

    from lambjax.contrib import precision

    terms = np.random.default_rng(seed).standard_normal((sums, n)).astype(np.float32)
    ones = jnp.ones((n, 1), jnp.float32)
    accumulate = jax.jit(
        lambda a: precision.chunked_dot(
            a,
            ones,
            chunk_size=chunk_size,
            accumulation_dtype=f"e{exponent_bits}m{mantissa_bits}",
        )
    )
    computed = np.asarray(accumulate(jnp.asarray(terms)), np.float64)[:, 0]
    exact = terms.astype(np.float64).sum(axis=1)
    return float(np.var(computed) / np.var(exact))
