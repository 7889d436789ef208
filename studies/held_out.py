"""What one held-out evaluation of the CPU studies can resolve: how many predictions it
scores, the loss of a unigram model on them (the plateau every run leaves first), and the
standard error of a held-out loss over that many predictions.

  python -m studies.held_out --data_dir=DIR [--eval_batch_size 32] [--seeds 0 1]
  python -m studies.held_out --config=studies/batch_scaling/config.py --data_dir=DIR

finds (or builds) the study's dataset in DIR: with no --config the CPU studies' shared
set-up (studies.common.cpu_study_config, the embedded corpus, sequence 32, 5 predictions);
with --config a study's config (its data, its first phase's sequence length and
predictions, its eval_batch_size and eval_steps). It masks the held-out split as an
evaluation does (batches of eval_batch_size, the remainder dropped, at most eval_steps of
them, the masks seeded by each seed) and scores every masked token with a unigram model
fitted to the training split's tokens (add-one smoothing). The per-token loss's standard
deviation under that model stands in for a trained model's, whose loss at these sizes sits
near the unigram level; the standard error is that deviation over the square root of the
predictions. It is the error of one evaluation as an estimate of the loss on the whole
distribution; two arms scored on the same masks share most of it, so their gap's error is
smaller and is not measured here.
"""

import argparse
import collections
import math

import numpy as np

from lambjax import cli
from lambjax.data import builder, reader
from studies import common


def unigram(token_ids) -> dict:
    """token id -> count, from an iterable of ids."""
    return collections.Counter(token_ids)


def scores(counts: dict, vocab_size: int, targets) -> dict:
    """The unigram model's loss on `targets` (add-one smoothing over `vocab_size`): their
    number, mean, per-token standard deviation, standard error, and the share of the most
    frequent target (the accuracy of always predicting it)."""
    total = sum(counts.values()) + vocab_size
    losses = np.array([-math.log((counts.get(t, 0) + 1) / total) for t in targets])
    deviation = float(losses.std(ddof=1))
    most = collections.Counter(targets).most_common(1)[0][1]
    return {
        "predictions": len(losses),
        "unigram_loss": float(losses.mean()),
        "per_token_sd": deviation,
        "standard_error": deviation / math.sqrt(len(losses)),
        "most_frequent_share": most / len(losses),
    }


def masked_targets(
    prepared, eval_batch_size: int, seed: int, max_predictions: int, eval_steps: int = 0
) -> list[int]:
    """The token ids an evaluation scores: every masked position of the held-out batches
    (the first `eval_steps` of them; 0: all)."""
    batches = reader.make_iterator(
        prepared,
        split="validation",
        global_batch_size=eval_batch_size,
        max_predictions_per_seq=max_predictions,
        seed=seed,
        num_epochs=1,
        read_threads=0,
    )
    targets = []
    for index, batch in enumerate(batches):
        if eval_steps and index >= eval_steps:
            break
        targets += batch["masked_lm_ids"][batch["masked_lm_weights"] > 0].tolist()
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="where the dataset is (or goes)")
    parser.add_argument(
        "--config", help="a study's config (FILE[:ARG]); default: the shared set-up"
    )
    parser.add_argument("--eval_batch_size", type=int, help="default: the config's, or 32")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    if args.config:
        config = cli.load_config(args.config)
        phase = config.phases[config.phase_order[0]]
        length, predictions = phase.max_seq_length, phase.max_predictions_per_seq
        eval_batch_size, eval_steps = config.eval_batch_size, config.eval_steps
    else:
        config = common.cpu_study_config()
        length, predictions, eval_batch_size, eval_steps = 32, 5, 32, 0
    eval_batch_size = args.eval_batch_size or eval_batch_size
    if eval_batch_size <= 0:
        parser.error(f"--eval_batch_size={eval_batch_size} must be positive")
    prepared = builder.prepare(config.data, length, data_dir=args.data_dir)
    special = set(prepared.special_ids.values())
    train = prepared.data_sources["train"]
    counts = unigram(
        t for i in range(len(train)) for t in np.ravel(train[i]["input_ids"]) if t not in special
    )
    held_out = prepared.num_examples("validation")
    evaluated = held_out // eval_batch_size * eval_batch_size
    if eval_steps:
        evaluated = min(evaluated, eval_steps * eval_batch_size)
    print(
        f"train {prepared.num_examples('train'):,} sequences; held-out {held_out}, of which "
        f"an evaluation at batch {eval_batch_size} scores {evaluated}"
    )
    for seed in args.seeds:
        targets = masked_targets(prepared, eval_batch_size, seed, predictions, eval_steps)
        s = scores(counts, prepared.vocab_size, targets)
        print(
            f"masks of seed {seed}: {s['predictions']} predictions, unigram loss "
            f"{s['unigram_loss']:.4f}, per-token sd {s['per_token_sd']:.2f}, standard error "
            f"{s['standard_error']:.4f}, most frequent target {100 * s['most_frequent_share']:.2f}%"
        )


if __name__ == "__main__":
    main()
