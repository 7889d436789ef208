"""Error of chunk-based low-precision accumulation against chunk size (lambjax.contrib.precision).

  python -m studies.chunked_accumulation.benchmark [--length 2048] [--rows 64] [--columns 32]

The dot products of uniform [0, 1) float16 operands (all-positive terms: the running sum grows
and swamps later addends, the case Wang et al. 2018 and Sakr et al. 2019 address) and of
standard-normal ones, accumulated with `chunked_dot` in float16, in bfloat16, and as Wang et
al. 2018 do (operands rounded to 1-5-2, float8_e5m2, products and sums in 1-6-9, e6m9). For
each chunk size it prints the maximum relative error against float64 and its ratio to naive
accumulation (one chunk of the whole contraction, the named baseline), and the measured
variance retention ratio (the variance of the computed sums over that of the exact ones:
Sakr et al.'s measure, here measured; lambjax.contrib.variance_retention predicts it, and
studies/chunked_accumulation/config.py compares the two).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lambjax.contrib import precision

# (accumulation format, operand format). The 8-bit row is measured against the float64
# product of the operands as rounded to 1-5-2, so that it shows the accumulation's error.
FORMATS = [
    ("float16", None),
    ("bfloat16", None),
    ("e6m9", "float8_e5m2"),
    ("float32", None),
]


def operands(kind: str, rows: int, length: int, columns: int, seed: int):
    rng = np.random.default_rng(seed)
    draw = rng.uniform if kind == "uniform" else rng.standard_normal
    a = jnp.asarray(draw(size=(rows, length)), jnp.float16)
    b = jnp.asarray(draw(size=(length, columns)), jnp.float16)
    return a, b


def reference(a, b, operand_dtype) -> np.ndarray:
    """a @ b in float64, of the operands as chunked_dot rounds them."""
    (qa, sa), (qb, sb) = (precision.quantize(x, operand_dtype) for x in (a, b))
    return (np.asarray(qa, np.float64) / float(sa)) @ (np.asarray(qb, np.float64) / float(sb))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--columns", type=int, default=32)
    args = parser.parse_args()
    chunks = [1, 4, 16, 64, 256, 1024, args.length]
    for kind in ("uniform", "normal"):
        a, b = operands(kind, args.rows, args.length, args.columns, seed=0)
        metric = "max relative error" if kind == "uniform" else "RMS error / RMS of the sums"
        print(f"\n{kind} operands, contraction {args.length}, {a.shape[0] * b.shape[1]} sums")
        print(f"{'accumulator':<11} {'chunk':>6} {metric:>28} {'naive / this':>13} {'VRR':>7}")
        for dtype, operand_dtype in FORMATS:
            exact = reference(a, b, operand_dtype)
            errors, vrrs = {}, {}
            for chunk in chunks:
                accumulate = functools.partial(
                    precision.chunked_dot,
                    chunk_size=chunk,
                    accumulation_dtype=dtype,
                    operand_dtype=operand_dtype,
                )
                run = jax.jit(accumulate)
                out = np.asarray(run(a, b), np.float64)
                if kind == "uniform":
                    errors[chunk] = np.max(np.abs(out - exact) / np.abs(exact))
                else:
                    errors[chunk] = np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact**2))
                vrrs[chunk] = np.var(out) / np.var(exact)
            for chunk in chunks:
                ratio = errors[args.length] / errors[chunk]
                label = "naive" if chunk == args.length else str(chunk)
                name = f"{dtype}/fp8" if operand_dtype else dtype
                print(
                    f"{name:<11} {label:>6} {errors[chunk]:>28.3g} {ratio:>13.1f} "
                    f"{vrrs[chunk]:>7.4f}"
                )


if __name__ == "__main__":
    main()
