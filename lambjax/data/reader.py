"""The reader: grain over the TFDS ArrayRecord source, sharded per JAX process.

The global order is fixed by the seed alone: epoch e visits the examples in a seeded
permutation, cut into global batches of `global_batch_size` (the remainder is dropped).
Process p of P reads rows [p*b, (p+1)*b) of every global batch, b = global_batch_size / P,
so the global batch at step s is the same examples in the same order on any topology. The
iterator's state is the number of batches consumed: a resumed run (on any number of
processes) continues with exactly the batches an uninterrupted one would see.

With `packing` (lambjax.data.packing), the unit an epoch permutes and a batch's row holds is
a planned row of several examples instead of one example; the rest is the same.

An evaluation reads one epoch with `pad_last_batch`: the remainder is not dropped but makes
a last global batch, filled up with padding rows of zero weight (`masked_lm_weights` 0 and
`nsp_weights` 0, which every batch then carries), so that every example is scored once at
one batch shape.
"""

import grain
import numpy as np
from tensorflow_datasets.proto import tf_example_pb2 as example_pb2

from lambjax.data import masking
from lambjax.data import packing as packing_lib
from lambjax.data.builder import Prepared
from lambjax.data.sources import DataError

_UNBOUNDED_EPOCHS = 1 << 20


class BatchIterator:
    """Yields this process's part of each global batch as a dict of numpy arrays."""

    def __init__(self, make_iterator, batches_per_epoch: int, num_batches: int):
        self._make_iterator = make_iterator
        self.batches_per_epoch = batches_per_epoch
        self._num_batches = num_batches
        self._step = 0
        self._iterator = make_iterator(0)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._step >= self._num_batches:
            raise StopIteration
        batch = next(self._iterator)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self._step}

    def set_state(self, state: dict) -> None:
        self._step = int(state["step"])
        self._iterator = self._make_iterator(self._step)


def make_iterator(
    prepared: Prepared,
    *,
    split: str,
    global_batch_size: int,
    max_predictions_per_seq: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    num_epochs: int | None = None,
    read_threads: int = 2,
    packing: packing_lib.Packing | None = None,
    pad_last_batch: bool = False,
) -> BatchIterator:
    """An iterator over this process's rows of each global batch (see module docstring).

    `read_threads` threads read examples ahead of the consumer (0: synchronous reads).
    `packing`: rows of several examples each (lambjax.data.packing); None: one per row.
    `pad_last_batch`: one epoch of every example, the last batch padded (module docstring).
    """
    if pad_last_batch and (num_epochs != 1 or packing is not None):
        raise ValueError("pad_last_batch reads one epoch of unpacked examples (num_epochs=1)")
    if split not in prepared.data_sources:
        raise DataError(f"split {split!r} was not built; available: {list(prepared.data_sources)}")
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise DataError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"number of processes ({process_count})"
        )
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must lie in [0, {process_count})")
    reader = _BatchReader(
        prepared,
        split=split,
        global_batch_size=global_batch_size,
        local_batch_size=global_batch_size // process_count,
        process_index=process_index,
        seed=seed,
        options=masking_options(prepared, max_predictions_per_seq),
        packing=packing,
        pad_last_batch=pad_last_batch,
    )
    if num_epochs is None and reader.batches_per_epoch == 0:
        # An epoch of no batch would end an endless iterator at once (StopIteration).
        unit = "rows" if packing is not None else "examples"
        raise DataError(
            f"split {split!r} has {reader.num_units} {unit}, fewer than one global batch of "
            f"{global_batch_size}; valid: a global batch of at most {reader.num_units}, or a "
            "larger corpus"
        )
    epochs = _UNBOUNDED_EPOCHS if num_epochs is None else num_epochs
    num_batches = reader.batches_per_epoch * epochs

    def make(start_step: int):
        if reader.batches_per_epoch == 0:
            return iter(())
        dataset = grain.MapDataset.range(start_step, num_batches).map(reader.read_batch)
        # Threads read (and mask) batches ahead of the training step; 0 reads synchronously.
        options = grain.ReadOptions(
            num_threads=read_threads, prefetch_buffer_size=4 if read_threads else 0
        )
        return iter(dataset.to_iter_dataset(options))

    return BatchIterator(make, reader.batches_per_epoch, num_batches)


def masking_options(prepared: Prepared, max_predictions_per_seq: int) -> masking.MaskingOptions:
    return masking.MaskingOptions(
        vocab_size=prepared.vocab_size,
        mask_id=prepared.special_ids["mask"],
        special_ids=tuple(sorted(set(prepared.special_ids.values()))),
        max_predictions_per_seq=max_predictions_per_seq,
        masked_lm_prob=prepared.data_config["masked_lm_prob"],
        continuation_ids=prepared.continuation_ids,
        whole_word_masking=prepared.data_config["whole_word_masking"],
    )


class _BatchReader:
    """Reads, pads (or packs) and masks this process's rows of global batch `step` of one
    split.

    The unit an epoch permutes is an example, or with packing a planned row of examples
    (`units`: [rows, max examples] example indices, -1 for an empty slot).
    """

    def __init__(
        self,
        prepared: Prepared,
        *,
        split: str,
        global_batch_size: int,
        local_batch_size: int,
        process_index: int,
        seed: int,
        options: masking.MaskingOptions,
        packing: packing_lib.Packing | None = None,
        pad_last_batch: bool = False,
    ):
        source = prepared.data_sources[split]
        self.records = source.data_source  # the ArrayRecord reader under the TFDS source
        self.seq_len = prepared.max_seq_length
        self.units = None
        if packing is not None:
            lengths = example_lengths(self.records)
            self.units = packing_lib.plan_rows(
                lengths,
                packing_lib.most_predictions(lengths, options),
                max_seq_length=self.seq_len,
                max_predictions=options.max_predictions_per_seq,
                max_examples_per_row=packing.max_examples_per_row,
                seed=seed,
            )
        self.num_units = len(source) if self.units is None else len(self.units)
        self.pad_last_batch = pad_last_batch
        if pad_last_batch:  # the remainder too, in a last batch filled with padding rows
            self.batches_per_epoch = -(-self.num_units // global_batch_size)
            self.epoch_units = self.num_units
        else:  # the remainder dropped
            self.batches_per_epoch = self.num_units // global_batch_size
            self.epoch_units = self.batches_per_epoch * global_batch_size
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.process_index, self.seed, self.options = process_index, seed, options
        self.pad_id = prepared.special_ids["pad"]
        self.permutations: dict[int, np.ndarray] = {}

    def rows_of(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, unit index) of this process's rows of global batch `step`; with
        `pad_last_batch`, positions past the epoch's last example read example 0 (`padding`
        says which)."""
        epochs, offsets = np.divmod(self.positions(step), self.epoch_units)
        indices = np.empty(self.local_batch_size, np.int64)
        for epoch in np.unique(epochs):
            if epoch not in self.permutations:
                if len(self.permutations) > 1:
                    self.permutations.clear()  # an epoch or two at a time is enough
                rng = np.random.default_rng([self.seed, epoch])
                self.permutations[epoch] = rng.permutation(self.num_units)
            rows = epochs == epoch
            indices[rows] = self.permutations[epoch][offsets[rows]]
        if self.pad_last_batch:
            indices[self.padding(step)], epochs[self.padding(step)] = 0, 0
        return epochs, indices

    def positions(self, step: int) -> np.ndarray:
        """This process's rows of global batch `step`, as positions in the run's order."""
        first = step * self.global_batch_size + self.process_index * self.local_batch_size
        return np.arange(first, first + self.local_batch_size)

    def padding(self, step: int) -> np.ndarray:
        """Which of this process's rows of batch `step` are padding (`pad_last_batch`)."""
        return self.positions(step) >= self.num_units

    def read_batch(self, step: int) -> dict:
        epochs, indices = self.rows_of(step)
        if self.pad_last_batch:  # weights 0 on the padding rows, which read example 0
            batch = self.read_examples(epochs, indices)
            padding = self.padding(step)
            batch["masked_lm_weights"][padding] = 0
            batch["nsp_weights"] = (~padding).astype(np.float32)
            return batch
        if self.units is None:
            return self.read_examples(epochs, indices)
        table = self.units[indices]
        filled = table >= 0
        epochs = np.broadcast_to(epochs[:, None], table.shape)[filled]
        examples = self.read_examples(epochs, table[filled], with_lengths=True)
        return packing_lib.assemble(
            examples, table, self.seq_len, self.options.max_predictions_per_seq
        )

    def read_examples(self, epochs, indices, with_lengths: bool = False) -> dict:
        """Examples `indices` (read in `epochs`), padded and masked, one per row."""
        count, seq_len = len(indices), self.seq_len
        ids = np.full((count, seq_len), self.pad_id, np.int32)
        segments = np.zeros((count, seq_len), np.int32)
        lengths = np.zeros(count, np.int64)
        labels = np.zeros(count, np.int32)
        # One batched ArrayRecord read, then a protobuf parse per example: TFDS's generic
        # per-example decoding would cost several times more than everything else here.
        for row, record in enumerate(self.records.__getitems__(indices.tolist())):
            feature = example_pb2.Example.FromString(record).features.feature
            tokens = feature["input_ids"].int64_list.value
            lengths[row] = len(tokens)
            ids[row, : len(tokens)] = tokens
            segments[row, : len(tokens)] = feature["segment_ids"].int64_list.value
            labels[row] = feature["next_sentence_label"].int64_list.value[0]
        masked = masking.mask_batch(ids, lengths, epochs, indices, self.seed, self.options)
        input_mask = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int32)
        return {
            **masked,
            "input_mask": input_mask,
            "segment_ids": segments,
            "next_sentence_labels": labels,
            **({"lengths": lengths} if with_lengths else {}),
        }


def example_lengths(records, chunk: int = 4096) -> np.ndarray:
    """The number of tokens of every example of an ArrayRecord reader (one pass over it)."""
    lengths = np.zeros(len(records), np.int64)
    for start in range(0, len(records), chunk):
        batch = records.__getitems__(list(range(start, min(start + chunk, len(records)))))
        for offset, record in enumerate(batch):
            feature = example_pb2.Example.FromString(record).features.feature
            lengths[start + offset] = len(feature["input_ids"].int64_list.value)
    return lengths
