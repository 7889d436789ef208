"""The TFDS datasets of pretraining examples, and `prepare`, which finds or builds them.

One dataset per (source content, vocabulary, example options, max_seq_length): its
directory name is a hash of all of them, so identical inputs reuse the existing build and
any change builds a new one beside it (nothing is overwritten). A dataset is complete when
its dataset_info.json exists, written last by the build (lambjax.data.beam_build, one
Apache Beam pipeline for every sequence length asked for); readers require it. Stored as
ArrayRecord, for the random access grain needs.

The vocabulary (`data.vocab="train"`) is trained before the pipeline runs, streaming the
corpus through `tokenizers`' trainer (lambjax.data.tokenization): all of it when it is at
most `vocab_sample_mb`, else every k-th input unit, k = ceil(corpus MB / vocab_sample_mb),
a fixed sample spread over the whole corpus. Workers get the vocabulary itself, not a path.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os

import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from lambjax import ranges
from lambjax.data import examples as examples_lib
from lambjax.data import sources, tokenization
from lambjax.data.sources import DataError

tfds.disable_progress_bar()

VERSION = "1.0.0"


class NotPrepared(DataError):
    """The data a run needs is not built, and this caller may not build it."""


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
    directory: str = ""  # the dataset's TFDS directory

    def num_examples(self, split: str) -> int:
        return len(self.data_sources[split])


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The WordPiece vocabulary of a data config: its vocab.txt and its number of tokens."""

    file: str
    size: int


def default_data_dir() -> str:
    """Where the library's functions build when neither the call nor the config names a
    data_dir (the commands always name one: the run's WORKDIR/data by default)."""
    return os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def vocabulary(data_config, *, data_dir: str | None = None, build: bool = True) -> Vocabulary:
    """The vocabulary of `data_config`: its vocab.txt, or the one trained on the corpus
    (trained now where missing; without `build`, NotPrepared)."""
    config = _as_dict(data_config)
    data_dir = os.fspath(data_dir or config.get("data_dir") or default_data_dir())
    check_config(config)
    path = _vocab_path(config, data_dir)
    if config["vocab"] == "train" and not epath.Path(path).exists():
        if not build:
            raise NotPrepared(f"the vocabulary of config.data is not built in {data_dir}")
        with _build_lock(data_dir):
            if not epath.Path(path).exists():
                _train_vocab(config, _units(config), path)
    tokenizer = tokenization.load(path, config["lower_case"])
    return Vocabulary(path, tokenizer.get_vocab_size())


def _as_dict(data_config) -> dict:
    return data_config.to_dict() if hasattr(data_config, "to_dict") else dict(data_config)


def prepare(
    data_config,
    max_seq_length: int,
    *,
    data_dir: str | None = None,
    build: bool = True,
    beam_options: str | None = None,
) -> Prepared:
    """Finds (or, with `build`, builds) the dataset of `data_config` at `max_seq_length`."""
    return prepare_all(
        data_config, [max_seq_length], data_dir=data_dir, build=build, beam_options=beam_options
    )[max_seq_length]


def prepare_all(
    data_config,
    max_seq_lengths,
    *,
    data_dir: str | None = None,
    build: bool = True,
    beam_options: str | None = None,
    on_summary=None,
) -> dict[int, Prepared]:
    """The datasets of `data_config` at each of `max_seq_lengths`; those missing are built
    in one pipeline (`beam_options`: see beam_build.pipeline_options), or, without `build`,
    raise NotPrepared. `on_summary(summary)` is called after a build."""
    config = _as_dict(data_config)
    data_dir = os.fspath(data_dir or config.get("data_dir") or default_data_dir())
    check_config(config)
    seq_lengths = sorted(set(max_seq_lengths))
    found = _find(config, seq_lengths, data_dir)
    if found is not None:
        return found
    if not build:
        raise NotPrepared(_missing(config, seq_lengths, data_dir))
    with _build_lock(data_dir):  # sweep trials sharing a data_dir build once
        found = _find(config, seq_lengths, data_dir)
        if found is None:
            summary = _build(config, seq_lengths, data_dir, beam_options)
            if on_summary:
                on_summary(summary)
            else:
                logging.info("%s", summary_line(summary, data_dir))
            found = _find(config, seq_lengths, data_dir)
    assert found is not None, "a completed build is found"
    return found


def summary_line(summary, data_dir: str) -> str:
    counts = sorted(summary.skipped.items())
    skipped = ", ".join(f"{n} {reason}" for reason, n in counts if reason not in sources.REPAIRS)
    repaired = ", ".join(f"{n} {reason}" for reason, n in counts if reason in sources.REPAIRS)
    per_seq = "; ".join(
        f"seq {seq}: " + ", ".join(f"{n} {split}" for split, n in counts.items())
        for seq, counts in sorted(summary.examples.items())
    )
    reused = f", {summary.reused_units} reused" if summary.reused_units else ""
    rate = summary.megabytes / max(summary.seconds, 1e-9)
    return (
        f"prepare: {summary.documents} documents from {summary.num_units} input shards"
        f"{reused} (skipped: {skipped or 'none'}{'; repaired: ' + repaired if repaired else ''}); "
        f"examples {per_seq}; "
        f"{summary.megabytes:.1f} MB in {summary.seconds:.0f} s ({rate:.2f} MB/s); "
        f"wrote {epath.Path(data_dir) / 'pretraining_examples'}"
    )


def check_config(data_config) -> None:
    """`config.data`'s own values (before any data or vocabulary work): DataError naming the
    first bad field, its value and what would be valid."""
    config = _as_dict(data_config)
    sources.check_source(config["source"])
    fields = [
        ("validation_fraction", "[0, 1)", False),
        ("short_seq_prob", "[0, 1]", False),
        ("masked_lm_prob", "(0, 1]", False),
        ("build_shard_mb", "(0, inf)", False),
        ("vocab_sample_mb", "[0, inf)", False),
    ]
    if config["vocab"] == "train":
        fields.append(("vocab_size", "[1, inf)", True))
    for name, interval, integer in fields:
        try:
            ranges.check(f"config.data.{name}", config[name], interval, integer=integer)
        except ValueError as error:
            raise DataError(str(error)) from None


def _vocab_path(config: dict, data_dir: str) -> str:
    """config.data.vocab as a path, or "train": where the trained vocabulary lives."""
    if config["vocab"] != "train":
        return os.path.expanduser(config["vocab"])
    fingerprint = sources.fingerprint(config["source"], tfds_data_dir=config["tfds_data_dir"])
    key = hashlib.sha256(
        json.dumps(
            [fingerprint, config["vocab_size"], config["lower_case"], config["vocab_sample_mb"]]
        ).encode()
    ).hexdigest()[:16]
    return os.fspath(epath.Path(data_dir) / "lambjax_vocab" / key / "vocab.txt")


def _dataset_dir(config: dict, vocab_file: str, options, data_dir: str) -> str:
    inputs = {
        "source": sources.fingerprint(config["source"], tfds_data_dir=config["tfds_data_dir"]),
        "vocab": hashlib.sha256(epath.Path(vocab_file).read_bytes()).hexdigest(),
        "lower_case": config["lower_case"],
        "options": dataclasses.asdict(options),
        "validation_fraction": config["validation_fraction"],
        "build_seed": config["build_seed"],
        "shard_mb": config["build_shard_mb"],
    }
    key = "k" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return os.fspath(epath.Path(data_dir) / "pretraining_examples" / key / VERSION)


def _options(config: dict, tokenizer, max_seq_length: int) -> examples_lib.ExampleOptions:
    special = tokenization.special_ids(tokenizer)
    return examples_lib.ExampleOptions(
        max_seq_length=max_seq_length,
        next_sentence_prediction=config["next_sentence_prediction"],
        short_seq_prob=config["short_seq_prob"],
        cls_id=special["cls"],
        sep_id=special["sep"],
    )


def _complete(directory: str) -> bool:
    return (epath.Path(directory) / "dataset_info.json").exists()


def _find(config: dict, seq_lengths: list[int], data_dir: str) -> dict[int, Prepared] | None:
    """The complete datasets at every length, or None if any (or the vocabulary) is missing."""
    vocab_file = _vocab_path(config, data_dir)
    if config["vocab"] == "train" and not epath.Path(vocab_file).exists():
        return None
    tokenizer = tokenization.load(vocab_file, config["lower_case"])
    found = {}
    for seq in seq_lengths:
        directory = _dataset_dir(config, vocab_file, _options(config, tokenizer, seq), data_dir)
        if not _complete(directory):
            return None
        found[seq] = _read(directory, tokenizer, vocab_file, seq, config)
    return found


def _read(directory, tokenizer, vocab_file, seq, config) -> Prepared:
    builder = tfds.builder_from_directory(directory)
    vocab = tokenizer.get_vocab()
    return Prepared(
        data_sources={split: builder.as_data_source(split=split) for split in builder.info.splits},
        vocab_file=vocab_file,
        vocab_size=tokenizer.get_vocab_size(),
        special_ids=tokenization.special_ids(tokenizer),
        continuation_ids=tuple(sorted(i for t, i in vocab.items() if t.startswith("##"))),
        max_seq_length=seq,
        data_config=config,
        directory=directory,
    )


def _missing(config: dict, seq_lengths: list[int], data_dir: str) -> str:
    """One line naming what is not built."""
    vocab_file = _vocab_path(config, data_dir)
    if config["vocab"] == "train" and not epath.Path(vocab_file).exists():
        return f"the vocabulary and pretraining examples of config.data are not built in {data_dir}"
    tokenizer = tokenization.load(vocab_file, config["lower_case"])
    missing = [
        seq
        for seq in seq_lengths
        if not _complete(
            _dataset_dir(config, vocab_file, _options(config, tokenizer, seq), data_dir)
        )
    ]
    lengths = ", ".join(str(s) for s in missing)
    return f"the pretraining examples at max_seq_length {lengths} are not built in {data_dir}"


def _units(config: dict) -> list[sources.Unit]:
    return sources.list_units(
        config["source"],
        unit_bytes=int(config["build_shard_mb"] * 1e6),
        tfds_data_dir=config["tfds_data_dir"],
    )


def _train_vocab(config: dict, units: list[sources.Unit], path: str) -> None:
    """Streams the corpus, or a fixed sample of it, through the WordPiece trainer."""
    total_mb = sum(u.size_bytes for u in units) / 1e6
    sample_mb = config["vocab_sample_mb"]
    every = max(1, math.ceil(total_mb / sample_mb)) if sample_mb else 1
    sample = units[::every]
    skipped: dict[str, int] = {}
    read = {"documents": 0}

    def documents():
        for unit in sample:
            unit_documents, unit_skipped = sources.read_unit(unit)
            for reason, count in unit_skipped.items():
                skipped[reason] = skipped.get(reason, 0) + count
            read["documents"] += len(unit_documents)
            yield from unit_documents

    logging.info("Training a vocabulary on %d of %d input shards", len(sample), len(units))
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then moved into place: a crash never leaves a partial vocabulary (a
    # rerun trains it again; on GCS the final write is a single object upload).
    temporary = epath.Path(path).with_name("vocab.txt.incomplete")
    tokenization.train_vocab(documents, config["vocab_size"], config["lower_case"], temporary)
    if not read["documents"]:
        temporary.unlink(missing_ok=True)
        if skipped.get("files not UTF-8"):
            raise DataError(
                f"config.data.source={config['source']!r}: no file could be decoded as UTF-8 "
                f"({len(sample)} files)"
            )
        raise DataError(f"config.data.source={config['source']!r} holds no text")
    temporary.copy(path, overwrite=True)
    temporary.unlink(missing_ok=True)


def _build(config: dict, seq_lengths: list[int], data_dir: str, beam_options: str | None):
    from lambjax.data import beam_build

    units = _units(config)
    options = beam_build.pipeline_options(beam_options, len(units))  # bad options fail early
    runner = options.get_all_options()["runner"]
    if runner != "DirectRunner" and "://" not in data_dir:
        raise DataError(
            f"config.data.data_dir={data_dir!r} is local, but runner={runner} writes from its "
            "own machines: give a data_dir they can reach (gs://BUCKET/...)"
        )
    vocab_file = _vocab_path(config, data_dir)
    if config["vocab"] == "train" and not epath.Path(vocab_file).exists():
        _train_vocab(config, units, vocab_file)
    tokenizer = tokenization.load(vocab_file, config["lower_case"])
    targets = []
    for seq in seq_lengths:
        example_options = _options(config, tokenizer, seq)
        directory = _dataset_dir(config, vocab_file, example_options, data_dir)
        if not _complete(directory):
            epath.Path(directory).mkdir(parents=True, exist_ok=True)
            targets.append(beam_build.Target(directory, example_options))
    plan = beam_build.Plan(
        vocab=tokenization.read_vocab(vocab_file),
        lower_case=config["lower_case"],
        validation_fraction=config["validation_fraction"],
        build_seed=config["build_seed"],
        num_shards=len(units),
        targets=tuple(targets),
    )
    logging.info(
        "Building pretraining examples at seq %s from %d input shards in %s",
        [t.options.max_seq_length for t in targets],
        len(units),
        data_dir,
    )
    return beam_build.run(units, plan, options)


@contextlib.contextmanager
def _build_lock(data_dir: str):
    """One build at a time across processes sharing a local data_dir (e.g. the trials of a
    sweep): the others wait for it, then find what it built."""
    if "://" in data_dir:
        yield
        return
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
