"""The dataset build: one Apache Beam pipeline, one output shard per input unit.

    units | Create | Reshuffle | ParDo(BuildUnit)

Each `BuildUnit` call reads one unit of the source (`sources.Unit`: a text file, a byte
range of a large one, or a record range of a `tfds:` split), holds its documents out for
validation by hash, tokenizes them once, and for every dataset being built (one per
sequence length) makes its examples and writes them as shard `unit.index` of each split,
an ArrayRecord file named as TFDS names shards. There is no GroupByKey over examples, so
a worker's memory is one unit's, whatever the corpus (the Python DirectRunner keeps a
GroupByKey's data in memory); and which records land in which file depends on the inputs
alone, not on the runner or the number of workers. grain shuffles at read time, so the
writer need not. This is Google's per-file build (create_pretraining_data.py runs once per
input file) on Beam, the engine TFDS builds its own large datasets with
(https://www.tensorflow.org/datasets/beam_datasets).

Completion: a unit writes a small record (its counts) after its shards; when every unit's
record is there, the driver registers the files with `tfds.folder_dataset.write_metadata`,
whose dataset_info.json is the completion marker readers require. Nothing is renamed (GCS
has no atomic rename): an interrupted build has no dataset_info.json and never looks
complete, and a rerun skips the units already recorded and finishes the rest.
"""

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import threading
import time

import apache_beam as beam
from apache_beam.options import pipeline_options as beam_options
from etils import epath
from tensorflow_datasets.proto import tf_example_pb2 as example_pb2

from lambjax.data import examples as examples_lib
from lambjax.data import sources, tokenization
from lambjax.data.sources import DataError

DATASET_NAME = "pretraining_examples"
SPLITS = ("train", "validation")
_UNITS_DIR = "_units"  # per-unit completion records, inside the dataset's directory
_COUNTERS = "lambjax"
_RUNNERS = {
    "DirectRunner",
    "DataflowRunner",
    "FlinkRunner",
    "SparkRunner",
    "PortableRunner",
    "PrismRunner",
}


@dataclasses.dataclass(frozen=True)
class Target:
    """One dataset to build: the examples at one sequence length, in `directory`."""

    directory: str  # the TFDS version directory (.../pretraining_examples/KEY/1.0.0)
    options: examples_lib.ExampleOptions


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a worker needs (pickled with the DoFn: no file it must find locally)."""

    vocab: dict[str, int]
    lower_case: bool
    validation_fraction: float
    build_seed: int
    num_shards: int
    targets: tuple[Target, ...]


def held_out(document_number: int, build_seed: int, validation_fraction: float) -> bool:
    """Validation holds out the documents whose seeded hash falls below the fraction. A
    document's number is its input shard's index x 2^32 + its position in the shard (in a
    corpus of one shard, its position: the rule lambjax always had)."""
    digest = hashlib.sha256(f"{build_seed}:{document_number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < validation_fraction


def shard_path(directory: str, split: str, index: int, num_shards: int) -> epath.Path:
    name = f"{DATASET_NAME}-{split}.array_record-{index:05d}-of-{num_shards:05d}"
    return epath.Path(directory) / name


def unit_record_path(directory: str, index: int) -> epath.Path:
    return epath.Path(directory) / _UNITS_DIR / f"unit-{index:05d}.json"


def serialize(example: dict) -> bytes:
    """A tf.train.Example, as TFDS serializes these features (int64 lists)."""
    proto = example_pb2.Example()
    feature = proto.features.feature
    feature["input_ids"].int64_list.value.extend(example["input_ids"].tolist())
    feature["segment_ids"].int64_list.value.extend(example["segment_ids"].tolist())
    feature["next_sentence_label"].int64_list.value.append(int(example["next_sentence_label"]))
    return proto.SerializeToString(deterministic=True)  # map order fixed: same bytes anywhere


def write_shard(path: epath.Path, records: list[bytes]) -> int:
    """Writes one ArrayRecord file (written locally, then copied where the path is remote);
    returns its size in bytes."""
    from array_record.python import array_record_module

    local = not str(path).startswith(("gs://", "s3://"))
    if local:
        target = os.fspath(path)
    else:
        handle, target = tempfile.mkstemp(suffix=".array_record")
        os.close(handle)
    writer = array_record_module.ArrayRecordWriter(target, "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    size = os.path.getsize(target)
    if not local:
        epath.Path(target).copy(path, overwrite=True)
        os.remove(target)
    return size


class BuildUnit(beam.DoFn):
    """Builds every target's shard of one unit; yields the unit's index when done."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._tokenizer = None

    def setup(self):
        self._tokenizer = tokenization.from_vocab(self._plan.vocab, self._plan.lower_case)

    def process(self, unit: sources.Unit):
        plan = self._plan
        pending = [
            t for t in plan.targets if not unit_record_path(t.directory, unit.index).exists()
        ]
        if not pending:
            beam.metrics.Metrics.counter(_COUNTERS, "input shards reused").inc()
            yield unit.index
            return
        documents, skipped = sources.read_unit(unit)
        beam.metrics.Metrics.counter(_COUNTERS, "documents read").inc(len(documents))
        beam.metrics.Metrics.counter(_COUNTERS, "bytes read").inc(unit.size_bytes)
        by_split = {split: [] for split in SPLITS}
        for position, document in enumerate(documents):
            number = (unit.index << 32) + position
            validation = held_out(number, plan.build_seed, plan.validation_fraction)
            by_split["validation" if validation else "train"].append(document)
        tokenized = {
            split: examples_lib.tokenize_documents(docs, self._tokenizer)
            for split, docs in by_split.items()
        }
        for number, target in enumerate(pending):
            record = {"examples": {}, "bytes": {}, "documents": len(documents), "skipped": {}}
            for split in SPLITS:
                seed = _unit_seed(plan.build_seed, unit.index, split)
                examples, too_short = examples_lib.create_examples(
                    tokenized[split], target.options, seed
                )
                path = shard_path(target.directory, split, unit.index, plan.num_shards)
                record["bytes"][split] = write_shard(path, [serialize(e) for e in examples])
                record["examples"][split] = len(examples)
                for reason, count in too_short.items():
                    record["skipped"][reason] = record["skipped"].get(reason, 0) + count
                beam.metrics.Metrics.counter(
                    _COUNTERS, f"examples {split} seq {target.options.max_seq_length}"
                ).inc(len(examples))
            for reason, count in skipped.items():
                record["skipped"][reason] = record["skipped"].get(reason, 0) + count
            if number == 0:  # the unit's skips, counted once whatever the number of targets
                for reason, count in record["skipped"].items():
                    beam.metrics.Metrics.counter(_COUNTERS, f"skipped {reason}").inc(count)
            done = unit_record_path(target.directory, unit.index)
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(record))  # last: the unit is complete for this target
        yield unit.index


def _unit_seed(build_seed: int, index: int, split: str) -> int:
    """The example-making seed of one unit and split (random next sentences, short
    sequences and the shard's order draw from it; the unit is their whole world). Unit 0's
    are the seeds lambjax always used for a one-shard corpus (the demo's examples)."""
    return build_seed + 2 * index + (0 if split == "train" else 1)


def pipeline_options(spec: str | None, num_units: int) -> beam_options.PipelineOptions:
    """Beam options from `KEY=VALUE,...` (as `tfds build --beam_pipeline_options` reads
    them). Default: the DirectRunner, one worker per core (at most one per unit), in
    multi_processing mode; in_memory (no worker processes) for one worker."""
    given = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, has_value, value = item.partition("=")
        if not has_value or not key.strip():
            raise DataError(
                f"--beam_pipeline_options: {item!r} is not KEY=VALUE "
                "(e.g. direct_num_workers=2 or runner=DataflowRunner,temp_location=gs://...)"
            )
        given[key.strip()] = value.strip()
    runner = given.setdefault("runner", "DirectRunner")
    if runner not in _RUNNERS:
        raise DataError(
            f"--beam_pipeline_options: runner={runner!r} is not a Beam runner; "
            f"valid: {', '.join(sorted(_RUNNERS))}"
        )
    if runner == "DataflowRunner":
        examples = {"project": "my-project", "region": "us-central1", "temp_location": "gs://B/tmp"}
        missing = [key for key in examples if not given.get(key)]
        if missing:
            example = ",".join(f"{key}={value}" for key, value in examples.items())
            raise DataError(
                f"--beam_pipeline_options: runner=DataflowRunner needs "
                f"{', '.join(k + '=...' for k in missing)} (e.g. runner=DataflowRunner,{example})"
            )
        installs = ("setup_file", "requirements_file", "sdk_container_image")
        if not any(given.get(k) for k in installs):
            setup_file = epath.Path(__file__).parents[2] / "setup.py"
            if setup_file.exists():  # workers install lambjax from this source tree
                given["setup_file"] = os.fspath(setup_file)
    if runner == "DirectRunner":
        if "direct_num_workers" in given:
            try:
                workers = int(given["direct_num_workers"])
            except ValueError:
                workers = 0
            if workers < 1:
                raise DataError(
                    f"--beam_pipeline_options: direct_num_workers={given['direct_num_workers']}"
                    " must be a positive integer"
                )
        else:
            workers = max(1, min(os.cpu_count() or 1, num_units))
            given["direct_num_workers"] = str(workers)
        default_mode = "multi_processing" if workers > 1 else "in_memory"
        given.setdefault("direct_running_mode", default_mode)
        given.setdefault("default_sdk_harness_log_level", "WARNING")  # workers' start-up chatter
    flags = [f"--{key}={value}" for key, value in given.items()]
    return beam_options.PipelineOptions(flags)


@dataclasses.dataclass
class Summary:
    documents: int
    megabytes: float
    seconds: float
    skipped: dict[str, int]
    examples: dict[int, dict[str, int]]  # max_seq_length -> split -> examples
    reused_units: int
    num_units: int


def run(units: list[sources.Unit], plan: Plan, options: beam_options.PipelineOptions) -> Summary:
    """Runs the pipeline over `units` and registers every target with TFDS."""
    start = time.monotonic()
    direct = options.view_as(beam_options.StandardOptions).runner in (None, "DirectRunner")
    progress = _Progress(units, plan.targets[0].directory) if direct else None
    pipeline = beam.Pipeline(runner=_direct_runner(options) if direct else None, options=options)
    _ = (
        pipeline
        | "Units" >> beam.Create(units)
        | "Spread" >> beam.Reshuffle()
        | "Build" >> beam.ParDo(BuildUnit(plan))
    )
    try:
        result = pipeline.run()
        result.wait_until_finish()
    finally:
        if progress:
            progress.stop()
    counters = _counters(result)
    records = {t.directory: _unit_records(t.directory, len(units)) for t in plan.targets}
    examples = {}
    for target in plan.targets:
        examples[target.options.max_seq_length] = register(target, records[target.directory])
    first = records[plan.targets[0].directory]
    skipped = {}
    for record in first:
        for reason, count in record["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    return Summary(
        documents=sum(r["documents"] for r in first),
        megabytes=counters.get("bytes read", sum(u.size_bytes for u in units)) / 1e6,
        seconds=time.monotonic() - start,
        skipped=skipped,
        examples=examples,
        reused_units=counters.get("input shards reused", 0),
        num_units=len(units),
    )


def _direct_runner(options: beam_options.PipelineOptions):
    """The runner Beam's Python DirectRunner runs a batch pipeline on (FnApiRunner, which
    honours direct_num_workers and direct_running_mode), named here because the
    DirectRunner first tries PrismRunner, a binary it would download at run time."""
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    provision_info = fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    )
    return fn_runner.FnApiRunner(provision_info=provision_info)


def features():
    """The examples' TFDS schema (masking is applied when reading)."""
    import numpy as np
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict(
        {
            "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "segment_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "next_sentence_label": tfds.features.Scalar(dtype=np.int32),
        }
    )


def register(target: Target, records: list[dict]) -> dict[str, int]:
    """Writes the dataset's TFDS metadata (dataset_info.json last: the completion marker)."""
    import tensorflow_datasets as tfds

    num_shards = len(records)
    template = tfds.core.ShardedFileTemplate(
        data_dir=epath.Path(target.directory),
        template="{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
        dataset_name=DATASET_NAME,
        filetype_suffix="array_record",
    )
    counts, split_infos = {}, []
    for split in SPLITS:
        lengths = [r["examples"][split] for r in records]
        if sum(lengths) == 0:  # a split without examples is left out (its files removed)
            for index in range(num_shards):
                shard_path(target.directory, split, index, num_shards).unlink(missing_ok=True)
            continue
        counts[split] = sum(lengths)
        split_infos.append(
            tfds.core.SplitInfo(
                name=split,
                shard_lengths=lengths,
                num_bytes=sum(r["bytes"][split] for r in records),
                filename_template=template,
            )
        )
    if not counts.get("train"):
        raise DataError(
            f"the corpus gave no training examples at max_seq_length="
            f"{target.options.max_seq_length} (documents too short, or all held out)"
        )
    tfds.folder_dataset.write_metadata(
        data_dir=target.directory,
        features=features(),
        split_infos=split_infos,
        filename_template=template,
        check_data=False,
        description="lambjax pretraining examples (masking is applied when reading)",
    )
    return counts


def _unit_records(directory: str, num_units: int) -> list[dict]:
    records = []
    for index in range(num_units):
        path = unit_record_path(directory, index)
        if not path.exists():
            raise DataError(
                f"the build of {directory} is incomplete: input shard {index} has no record "
                f"({path}); run the same command again to finish it"
            )
        records.append(json.loads(path.read_text()))
    return records


def _counters(result) -> dict[str, int]:
    """The pipeline's lambjax counters by name ({} where a runner reports none)."""
    try:
        query = result.metrics().query(beam.metrics.MetricsFilter().with_namespace(_COUNTERS))
    except Exception:  # noqa: BLE001 - a runner without metrics support
        return {}
    totals: dict[str, int] = {}
    for counter in query["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + int(value or 0)
    return totals


class _Progress:
    """A line on stderr every few seconds: input shards done of total, MB/s, ETA (it lists
    the units' completion records, one listing a time, so it sees every worker process)."""

    def __init__(self, units: list[sources.Unit], directory: str, interval: float = 10.0):
        self._units, self._directory, self._interval = units, directory, interval
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _loop(self):
        total_bytes = sum(u.size_bytes for u in self._units) or 1
        while not self._stop.wait(self._interval):
            records = epath.Path(self._directory) / _UNITS_DIR
            names = {p.name for p in records.glob("unit-*.json")} if records.exists() else set()
            done = [u for u in self._units if unit_record_path("", u.index).name in names]
            elapsed = time.monotonic() - self._start
            done_bytes = sum(u.size_bytes for u in done)
            rate = done_bytes / 1e6 / elapsed
            fraction = done_bytes / total_bytes
            eta = f"{elapsed * (1 - fraction) / fraction:.0f} s" if fraction else "?"
            print(
                f"prepare: {len(done)}/{len(self._units)} input shards, {rate:.1f} MB/s, ETA {eta}",
                file=sys.stderr,
                flush=True,
            )
