"""The TFDS dataset of pretraining examples, and `prepare`, which builds or reuses it.

One dataset per (source content, vocabulary, example options, max_seq_length): its TFDS
config name is a hash of all of them, so identical inputs reuse the existing build and any
change builds a new one beside it (nothing is overwritten). TFDS writes into a temporary
directory and renames it when complete, so an interrupted build never looks complete.
Stored as ArrayRecord, for the random access grain needs. Validation holds whole
documents out (`validation_fraction` of them, chosen by a hash of the document index).
"""

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import tempfile

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from lambjax.data import examples as examples_lib
from lambjax.data import sources, tokenization
from lambjax.data.sources import DataError

tfds.disable_progress_bar()

FEATURES = tfds.features.FeaturesDict(
    {
        "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        "segment_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        "next_sentence_label": tfds.features.Scalar(dtype=np.int32),
    }
)


@dataclasses.dataclass
class Prepared:
    """A built dataset, ready for `make_iterator`."""

    data_sources: dict  # split name -> random-access source of examples
    vocab_file: str
    vocab_size: int
    special_ids: dict[str, int]  # pad, unk, cls, sep, mask
    continuation_ids: tuple[int, ...]  # "##" word pieces (whole word masking)
    max_seq_length: int
    data_config: dict

    def num_examples(self, split: str) -> int:
        return len(self.data_sources[split])


class PretrainingExamples(tfds.core.GeneratorBasedBuilder):
    """Tokenized BERT pretraining examples (masking is applied when reading)."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, key: str, description: str, make_examples=None, **kwargs):
        self._make_examples = make_examples
        self._description = description
        super().__init__(config=tfds.core.BuilderConfig(name=key), **kwargs)

    def _info(self):
        return self.dataset_info_from_configs(features=FEATURES, description=self._description)

    def _split_generators(self, dl_manager):
        del dl_manager
        splits = self._make_examples()
        return {name: self._generate_examples(examples) for name, examples in splits.items()}

    def _generate_examples(self, examples):
        yield from enumerate(examples)


def default_data_dir() -> str:
    return os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def prepare(data_config, max_seq_length: int, *, data_dir: str | None = None) -> Prepared:
    """Builds (or reuses) the dataset of `data_config` at `max_seq_length`."""
    config = data_config.to_dict() if hasattr(data_config, "to_dict") else dict(data_config)
    data_dir = data_dir or config.get("data_dir") or default_data_dir()
    _check_config(config)
    fingerprint = sources.fingerprint(config["source"], tfds_data_dir=config["tfds_data_dir"])

    @functools.cache
    def load_documents():  # only when the vocabulary or the examples must be built
        documents, skipped = sources.read_documents(
            config["source"], tfds_data_dir=config["tfds_data_dir"]
        )
        if not documents:
            raise DataError(f"config.data.source={config['source']!r} holds no text")
        for reason, count in skipped.items():
            logging.warning("Data build skipped %d %s", count, reason)
        return documents

    vocab_file = _vocab_file(config, fingerprint, data_dir, load_documents)
    tokenizer = tokenization.load(vocab_file, config["lower_case"])
    special = tokenization.special_ids(tokenizer)
    options = examples_lib.ExampleOptions(
        max_seq_length=max_seq_length,
        next_sentence_prediction=config["next_sentence_prediction"],
        short_seq_prob=config["short_seq_prob"],
        cls_id=special["cls"],
        sep_id=special["sep"],
    )
    inputs = {
        "source": fingerprint,
        "vocab": _file_hash(vocab_file),
        "lower_case": config["lower_case"],
        "options": dataclasses.asdict(options),
        "validation_fraction": config["validation_fraction"],
        "build_seed": config["build_seed"],
        "shard_documents": config["build_shard_documents"],
    }
    key = "k" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    with _build_lock(data_dir, key):  # the builder reads the dataset's info when made
        builder = PretrainingExamples(
            key=key,
            description=json.dumps({**inputs, "source": config["source"]}),
            make_examples=lambda: _split_examples(load_documents(), tokenizer, options, config),
            data_dir=data_dir,
            file_format="array_record",
        )
        if not builder.is_prepared():
            logging.info(
                "Building pretraining examples %s (seq %d) in %s", key, max_seq_length, data_dir
            )
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(
                    try_download_gcs=False, verify_ssl=False, max_examples_per_split=None
                )
            )
    vocab = tokenizer.get_vocab()
    return Prepared(
        data_sources={split: builder.as_data_source(split=split) for split in builder.info.splits},
        vocab_file=vocab_file,
        vocab_size=tokenizer.get_vocab_size(),
        special_ids=special,
        continuation_ids=tuple(sorted(i for t, i in vocab.items() if t.startswith("##"))),
        max_seq_length=max_seq_length,
        data_config=config,
    )


@contextlib.contextmanager
def _build_lock(data_dir: str, key: str):
    """One build of a dataset at a time across processes sharing a local data_dir (e.g. the
    trials of a sweep): the others wait for it, then read what it built."""
    if "://" in data_dir:
        yield
        return
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f".build-{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_config(config: dict) -> None:
    if not 0 <= config["validation_fraction"] < 1:
        raise DataError(
            f"config.data.validation_fraction={config['validation_fraction']} must lie in [0, 1)"
        )
    if not 0 <= config["short_seq_prob"] <= 1:
        raise DataError(f"config.data.short_seq_prob={config['short_seq_prob']} must lie in [0, 1]")


def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _vocab_file(config: dict, fingerprint: str, data_dir: str, load_documents) -> str:
    """config.data.vocab as a path, or "train": a vocabulary trained once per corpus."""
    if config["vocab"] != "train":
        return os.path.expanduser(config["vocab"])
    key = hashlib.sha256(
        json.dumps([fingerprint, config["vocab_size"], config["lower_case"]]).encode()
    ).hexdigest()[:16]
    path = os.path.join(data_dir, "lambjax_vocab", key, "vocab.txt")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Written beside, then renamed: a crash never leaves a partial vocabulary.
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".incomplete")
        os.close(handle)
        tokenization.train_vocab(
            load_documents(), config["vocab_size"], config["lower_case"], temporary
        )
        os.replace(temporary, path)
    return path


def _build_split(docs, tokenizer, options, seed, config) -> tuple[list[dict], dict]:
    """One split's examples. A large corpus is cut into shards of `build_shard_documents`
    documents, built in parallel on every core (the random next sentence is drawn from the
    same shard, as Google's per-file build does); the result depends on the shard size,
    never on the number of cores."""
    size = config["build_shard_documents"]
    shards = [docs[i : i + size] for i in range(0, len(docs), size)]
    if len(shards) == 1:
        return examples_lib.create_examples(
            examples_lib.tokenize_documents(docs, tokenizer), options, seed
        )
    vocab = tokenizer.get_vocab()
    jobs = [
        (shard, vocab, config["lower_case"], options, seed * 1_000_003 + i)
        for i, shard in enumerate(shards)
    ]
    context = multiprocessing.get_context("spawn")  # no fork of a threaded JAX/TF process
    workers = min(len(shards), os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        results = list(pool.map(examples_lib.build_shard, jobs))
    examples = [e for shard_examples, _ in results for e in shard_examples]
    skipped: dict[str, int] = {}
    for _, shard_skipped in results:
        for reason, count in shard_skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return examples, skipped


def _split_examples(documents, tokenizer, options, config) -> dict[str, list[dict]]:
    """Holds out whole documents for validation, then makes each split's examples."""
    fraction = config["validation_fraction"]
    by_split = {"train": [], "validation": []}
    for index, document in enumerate(documents):
        digest = hashlib.sha256(f"{config['build_seed']}:{index}".encode()).digest()
        draw = int.from_bytes(digest[:8], "little") / 2**64
        by_split["validation" if draw < fraction else "train"].append(document)
    out = {}
    for split, docs in by_split.items():
        if not docs:
            continue
        seed = config["build_seed"] + (0 if split == "train" else 1)
        examples, skipped = _build_split(docs, tokenizer, options, seed, config)
        for reason, count in skipped.items():
            logging.warning("Data build (%s) skipped %d %s", split, count, reason)
        if examples:
            out[split] = examples
        else:
            logging.warning("Data build: the %s split has no examples; it is left out", split)
    if not out.get("train"):
        raise DataError(
            f"config.data.source={config['source']!r} gave no training examples "
            f"({len(documents)} documents; too short or all held out for validation)"
        )
    logging.info(
        "Built %s examples at seq %d",
        {k: len(v) for k, v in out.items()},
        options.max_seq_length,
    )
    return out
