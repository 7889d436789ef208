"""Error of chunk-based low-precision accumulation against chunk size (lambjax.precision).

  python benchmarks/chunked_accumulation.py [--length 2048] [--rows 64] [--columns 32]

The dot products of uniform [0, 1) float16 operands (all-positive terms: the running sum grows
and swamps later addends, the case Wang et al. 2018 and Sakr et al. 2019 address) and of
standard-normal ones, accumulated in float16 and in bfloat16 with `chunked_dot`. For each
chunk size it prints the maximum relative error against float64 and its ratio to naive
accumulation (one chunk of the whole contraction, the named baseline), and the variance
retention ratio of Sakr et al. (variance of the computed sums over that of the exact ones).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from lambjax import precision


def operands(kind: str, rows: int, length: int, columns: int, seed: int):
    rng = np.random.default_rng(seed)
    draw = rng.uniform if kind == "uniform" else rng.standard_normal
    a = jnp.asarray(draw(size=(rows, length)), jnp.float16)
    b = jnp.asarray(draw(size=(length, columns)), jnp.float16)
    return a, b


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--columns", type=int, default=32)
    args = parser.parse_args()
    chunks = [1, 4, 16, 64, 256, 1024, args.length]
    for kind in ("uniform", "normal"):
        a, b = operands(kind, args.rows, args.length, args.columns, seed=0)
        exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        metric = "max relative error" if kind == "uniform" else "RMS error / RMS of the sums"
        print(f"\n{kind} operands, contraction {args.length}, {a.shape[0] * b.shape[1]} sums")
        print(f"{'accumulator':<11} {'chunk':>6} {metric:>28} {'naive / this':>13} {'VRR':>7}")
        for dtype in ("float16", "bfloat16", "float32"):
            errors, vrrs = {}, {}
            for chunk in chunks:
                run = jax.jit(
                    lambda a, b, chunk=chunk, dtype=dtype: precision.chunked_dot(
                        a, b, chunk_size=chunk, accumulation_dtype=dtype
                    )
                )
                out = np.asarray(run(a, b), np.float64)
                if kind == "uniform":
                    errors[chunk] = np.max(np.abs(out - exact) / np.abs(exact))
                else:
                    errors[chunk] = np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact**2))
                vrrs[chunk] = np.var(out) / np.var(exact)
            for chunk in chunks:
                ratio = errors[args.length] / errors[chunk]
                label = "naive" if chunk == args.length else str(chunk)
                print(
                    f"{dtype:<11} {label:>6} {errors[chunk]:>28.3g} {ratio:>13.1f} "
                    f"{vrrs[chunk]:>7.4f}"
                )


if __name__ == "__main__":
    main()
