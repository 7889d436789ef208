"""Packing at sequence 512: the padding before and after, and real (non-padding) tokens per
second of the train step with packed rows against one example per row (the baseline),
measured in one run.

  python benchmarks/packing.py [--corpora embedded,stdlib] [--steps 24] [--rounds 6]

Corpora: `embedded` (CPython's pydoc topics, the demo's corpus) and `stdlib`, a larger one
built here from what is installed: the docstrings of this Python's standard library (one
document per module, its docstrings joined; test packages left out) beside the pydoc topics,
written as a text corpus into the data directory. Each is built (vocabulary trained, 4,096
pieces, as in the demo) on first use.

The step is the demo's phase 2: the tiny model in bfloat16 compute with its 2 layers
unrolled, 8 rows of 512 tokens, 80 predictions, LAMB, jitted with donation as the trainer
jits it, on 2 CPU cores as XLA:CPU runs it. Each side cycles over the first batches of its
training iterator, read beforehand (the input pipeline is not timed; its cost per batch is
printed apart). The sides take turns, `--rounds` rounds of `--steps / --rounds` steps (the
order alternating) so that the machine's drift hits both alike; each side's median step
time over all rounds gives its real tokens/s = the mean real tokens per step / the median.
"""

import argparse
import ast
import functools
import os
import statistics
import sysconfig
import tempfile
import time

import numpy as np

from lambjax import data, host_memory
from lambjax.data import packing, reader

SEQ, PREDICTIONS, ROWS, MAX_EXAMPLES = 512, 80, 8, 3


def stdlib_corpus(path: str) -> str:
    """Writes the stdlib-docstring corpus (and the pydoc topics) to `path`; its source."""
    from pydoc_data import topics

    root = sysconfig.get_paths()["stdlib"]
    documents = [text for _, text in sorted(topics.topics.items()) if text.strip()]
    for directory, subdirectories, files in os.walk(root):  # top-down, in sorted order
        subdirectories[:] = sorted(
            d for d in subdirectories if d not in ("test", "tests", "site-packages")
        )
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            docstrings = [
                ast.get_docstring(node)
                for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            ]
            text = " ".join(" ".join(d.split()) for d in docstrings if d)
            if len(text) > 200:
                documents.append(text)
    # A text corpus separates documents by blank lines: keep each one a single paragraph.
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(" ".join(d.split()) for d in documents) + "\n")
    return f"text:{path}"


def prepared_corpus(name: str, data_dir: str) -> data.Prepared:
    config = data.default_config()
    config.data_dir = data_dir
    config.vocab_size = 4096
    if name == "stdlib":
        config.source = stdlib_corpus(os.path.join(data_dir, "stdlib_docstrings.txt"))
    elif name != "embedded":
        raise SystemExit(f"--corpora: unknown corpus {name!r}; valid: embedded, stdlib")
    return data.prepare(config, SEQ)


def padding(prepared: data.Prepared) -> dict:
    """The training split's padding fraction, one example per row and packed, and the
    seconds an iterator spends planning the rows (the length pass and the plan)."""
    start = time.perf_counter()
    lengths = reader.example_lengths(prepared.data_sources["train"].data_source)
    options = reader.masking_options(prepared, PREDICTIONS)
    table = packing.plan_rows(
        lengths,
        packing.most_predictions(lengths, options),
        max_seq_length=SEQ,
        max_predictions=PREDICTIONS,
        max_examples_per_row=MAX_EXAMPLES,
        seed=0,
    )
    return {
        "plan_seconds": time.perf_counter() - start,
        "examples": len(lengths),
        "packed_rows": len(table),
        "padding_unpacked": packing.padding_fraction(lengths, len(lengths), SEQ),
        "padding_packed": packing.padding_fraction(lengths, len(table), SEQ),
    }


def read_batches(prepared, packed: bool, count: int):
    """(the first `count` batches of the training iterator, seconds per batch read)."""
    iterator = data.make_iterator(
        prepared,
        split="train",
        global_batch_size=ROWS,
        max_predictions_per_seq=PREDICTIONS,
        seed=0,
        read_threads=0,
        packing=packing.Packing(MAX_EXAMPLES) if packed else None,
    )
    start = time.perf_counter()
    batches = [next(iterator) for _ in range(min(count, iterator.batches_per_epoch))]
    return batches, (time.perf_counter() - start) / len(batches)


def make_step(vocab_size: int):
    """(jitted step(state, batch) -> state, initial-state factory): the demo's phase 2."""
    import jax
    import optax

    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params
    from lambjax.train import step as step_lib
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer
    from lambjax.train.state import TrainState

    config = BertConfig.preset("tiny", vocab_size=vocab_size, scan_layers=False, attention="xla")
    schedule = optax.constant_schedule(5e-3)
    optimizer = make_optimizer(optimizer_config("lamb"), schedule)
    train_step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=config,
                optimizer=optimizer,
                schedule=schedule,
                grad_accum_steps=1,
            ),
        ),
        donate_argnums=(0,),
    )
    rng = jax.random.key(1)
    init = jax.jit(lambda k: TrainState.create(init_params(config, k), optimizer))
    return (lambda state, batch: train_step(state, batch, rng)[0]), lambda: init(jax.random.key(0))


def timed(step, state, batches, first: int, steps: int):
    """(state after `steps` steps on batches first, first + 1, ... (cycling), step seconds)."""
    import jax

    times = []
    for i in range(steps):
        batch = batches[(first + i) % len(batches)]
        start = time.perf_counter()
        state = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - start)
    return state, times


def measure(prepared, steps: int, rounds: int) -> dict:
    import jax

    step, init = make_step(prepared.vocab_size)
    sides = {}
    for name, packed in (("unpacked", False), ("packed", True)):
        batches, read_seconds = read_batches(prepared, packed, count=16)
        batches = [jax.device_put(b) for b in batches]
        state, _ = timed(step, init(), batches, 0, 2)  # compile and warm up
        real = statistics.mean(float(np.sum(b["input_mask"])) for b in batches)
        examples = statistics.mean(
            float(np.sum(b["nsp_weights"])) if packed else ROWS for b in batches
        )
        sides[name] = dict(state=state, batches=batches, real=real, examples=examples)
        sides[name].update(times=[], read_seconds=read_seconds, done=0)
    per_round = -(-steps // rounds)
    for index in range(rounds):
        order = ("unpacked", "packed") if index % 2 == 0 else ("packed", "unpacked")
        for name in order:
            side = sides[name]
            side["state"], times = timed(
                step, side["state"], side["batches"], side["done"], per_round
            )
            side["times"] += times
            side["done"] += per_round
    results = {}
    for name, side in sides.items():
        seconds = statistics.median(side["times"])
        results[name] = {
            "step_ms": 1e3 * seconds,
            "real_tokens_per_step": side["real"],
            "examples_per_step": side["examples"],
            "real_tokens_per_s": side["real"] / seconds,
            "read_ms_per_batch": 1e3 * side["read_seconds"],
        }
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", default="embedded,stdlib")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "lambjax_bench"))
    args = parser.parse_args()
    host_memory.retain_freed_memory()
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}")
    for name in args.corpora.split(","):
        prepared = prepared_corpus(name, args.data_dir)
        pad = padding(prepared)
        result = measure(prepared, args.steps, args.rounds)
        base, packed = result["unpacked"], result["packed"]
        print(
            f"{name}: {pad['examples']} training examples at {SEQ} -> {pad['packed_rows']} "
            f"packed rows; padding {pad['padding_unpacked']:.1%} -> {pad['padding_packed']:.1%}; "
            f"the lengths read and the rows planned in {pad['plan_seconds']:.2f} s"
        )
        for side, r in result.items():
            print(
                f"  {side:9s} step {r['step_ms']:.0f} ms, {r['examples_per_step']:.2f} examples "
                f"and {r['real_tokens_per_step']:.0f} real tokens per step of {ROWS}x{SEQ}: "
                f"{r['real_tokens_per_s']:.0f} real tokens/s (reading: "
                f"{r['read_ms_per_batch']:.1f} ms/batch)"
            )
        ratio = packed["real_tokens_per_s"] / base["real_tokens_per_s"]
        print(f"  packed / unpacked real tokens/s: {ratio:.2f}x")
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
