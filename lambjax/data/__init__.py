"""Pretraining data: sources, WordPiece, BERT examples in a TFDS dataset, grain reader.

The datasets are built by one Apache Beam pipeline (beam_build; `python -m lambjax.prepare`
runs it ahead of training); `prepare` finds them, or builds what is missing.

prepared = data.prepare(config.data, max_seq_length=128)
batches = data.make_iterator(prepared, split="train", global_batch_size=256,
                             max_predictions_per_seq=20, seed=0,
                             process_index=jax.process_index(),
                             process_count=jax.process_count())
"""

import ml_collections

from lambjax import storage  # noqa: F401 - gs:// through lambjax's path layer, set up first
from lambjax.data.builder import (
    NotPrepared,
    Prepared,
    Vocabulary,
    check_config,
    prepare,
    prepare_all,
    vocabulary,
)
from lambjax.data.reader import BatchIterator, make_iterator
from lambjax.data.sources import DataError


def default_config() -> ml_collections.ConfigDict:
    """The data fields of an experiment config (`config.data`)."""
    return ml_collections.ConfigDict(
        {
            # "embedded" | "text:GLOB" | "tfds:NAME[:SPLIT]"
            "source": "embedded",
            # A BERT vocab.txt path, or "train" (WordPiece trained on the corpus).
            "vocab": "train",
            "vocab_size": 8192,  # when training the vocabulary
            "lower_case": True,
            "whole_word_masking": False,
            # True: BERT's A/B sentence pairs with 50% random next; False: full-sentence
            # packing without NSP.
            "next_sentence_prediction": True,
            "short_seq_prob": 0.1,
            "masked_lm_prob": 0.15,
            # Training rows of several whole examples each, up to packing_max_examples, with
            # per-example attention, positions and NSP (lambjax.data.packing): a phase's
            # global_batch_size then counts rows, and a row holds more than one example on
            # average. Held-out evaluation reads one example per row either way.
            "packing": False,
            "packing_max_examples": 3,
            "validation_fraction": 0.05,  # of documents, held out whole
            "build_seed": 12345,
            # The unit of work of the build (lambjax.prepare): a text file larger than this
            # is cut into pieces of about this size at document boundaries; a tfds: split
            # into record ranges of about this much data. One output shard per unit.
            "build_shard_mb": 32.0,
            # data.vocab="train" trains on the whole corpus up to this size, else on every
            # k-th input unit, k = ceil(corpus MB / vocab_sample_mb); 0: the whole corpus.
            "vocab_sample_mb": 256.0,
            # Where built datasets (and trained vocabularies) live; None: the run's
            # WORKDIR/data (lambjax.main, lambjax.prepare --workdir, a sweep's DIR/data).
            "data_dir": ml_collections.FieldReference(None, field_type=str),
            # TFDS data dir of a `tfds:` source; None: TFDS's default.
            "tfds_data_dir": ml_collections.FieldReference(None, field_type=str),
        }
    )


__all__ = [
    "BatchIterator",
    "check_config",
    "DataError",
    "NotPrepared",
    "Prepared",
    "default_config",
    "make_iterator",
    "prepare",
    "prepare_all",
    "vocabulary",
    "Vocabulary",
]


def paths(data_config) -> list[tuple[str, str]]:
    """(flag, path) of every path a data config names, for checks before any work."""
    found = [("--config.data.data_dir", data_config.data_dir)]
    found.append(("--config.data.tfds_data_dir", data_config.tfds_data_dir))
    if data_config.vocab != "train":
        found.append(("--config.data.vocab", data_config.vocab))
    if data_config.source.startswith("text:"):
        found.append(("--config.data.source", data_config.source[len("text:") :]))
    return [(flag, path) for flag, path in found if path]
