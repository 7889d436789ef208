"""Input pipeline throughput: masked batches per second on one core, and build tokens/s.

  python benchmarks/input_pipeline.py [--batches 50]

Reads the embedded corpus's datasets (built first if needed, timed: tokens/s of the build)
through the grain reader pinned to one CPU core (grain in-process, no worker processes),
at sequence 128 (20 predictions) and 512 (80). The baseline, measured in the same run, is
the same reader with Google BERT's per-example masking loop (create_masked_lm_predictions
in Python) in place of lambjax's vectorised masking. Target: >= 10,000 phase-1 sequences/s
per core.
"""

import argparse
import os
import random
import tempfile
import time

import numpy as np

from lambjax import data
from lambjax.data import masking, reader

TARGET = 10_000


def google_style_mask_batch(input_ids, lengths, epoch, index, seed, options):
    """Per example, per token Python (the original create_pretraining_data approach)."""
    out = {
        k: [] for k in ("input_ids", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights")
    }
    special = set(options.special_ids)
    for row, length, e, i in zip(input_ids, lengths, epoch, index, strict=True):
        rng = random.Random(hash((seed, int(e), int(i))))
        tokens = row.tolist()
        candidates = [p for p in range(int(length)) if tokens[p] not in special]
        rng.shuffle(candidates)
        n = min(options.max_predictions_per_seq, max(1, round(int(length) * 0.15)))
        chosen = sorted(candidates[:n])
        labels = [tokens[p] for p in chosen]
        for p in chosen:
            r = rng.random()
            tokens[p] = (
                options.mask_id
                if r < 0.8
                else (rng.randrange(5, options.vocab_size) if r < 0.9 else tokens[p])
            )
        pad = options.max_predictions_per_seq - len(chosen)
        out["input_ids"].append(tokens)
        out["masked_lm_positions"].append(chosen + [0] * pad)
        out["masked_lm_ids"].append(labels + [0] * pad)
        out["masked_lm_weights"].append([1.0] * len(chosen) + [0.0] * pad)
    return {k: np.asarray(v) for k, v in out.items()}


def sequences_per_second(prepared, predictions, batches, batch_size=256):
    iterator = data.make_iterator(
        prepared,
        split="train",
        global_batch_size=min(batch_size, prepared.num_examples("train")),
        max_predictions_per_seq=predictions,
        seed=0,
        read_threads=0,  # synchronous: every timed batch is read and masked in the loop
    )
    next(iterator)  # warm up
    start = time.perf_counter()
    count = 0
    for _ in range(batches):
        count += len(next(iterator)["input_ids"])
    return count / (time.perf_counter() - start)


def build_tokens_per_second(config, seq):
    start = time.perf_counter()
    prepared = data.prepare(config, seq)
    seconds = time.perf_counter() - start
    tokens = sum(
        len(prepared.data_sources[split][i]["input_ids"])
        for split in prepared.data_sources
        for i in range(len(prepared.data_sources[split]))
    )
    return prepared, tokens / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args()
    config = data.default_config()
    config.data_dir = tempfile.mkdtemp(prefix="lambjax-bench-")
    cores = len(os.sched_getaffinity(0))
    rows = []
    for seq, predictions in ((128, 20), (512, 80)):
        prepared, build_rate = build_tokens_per_second(config, seq)
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
        ours = sequences_per_second(prepared, predictions, args.batches)
        original = masking.mask_batch
        reader.masking.mask_batch = google_style_mask_batch
        try:
            baseline = sequences_per_second(prepared, predictions, max(3, args.batches // 10))
        finally:
            reader.masking.mask_batch = original
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        rows.append((seq, ours, baseline, build_rate))
    print(f"build: {cores} cores; pipeline: 1 core, batch 256")
    print(
        "| seq | lambjax seq/s (1 core) | Google-style masking seq/s | speed-up | vs 10,000 target "
        "| build tokens/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for seq, ours, baseline, build_rate in rows:
        print(
            f"| {seq} | {ours:,.0f} | {baseline:,.0f} | {ours / baseline:.1f}x | "
            f"{ours / TARGET:.2f}x | {build_rate:,.0f} |"
        )


if __name__ == "__main__":
    main()
