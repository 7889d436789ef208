"""The input pipeline: grain over the TFDS ArrayRecord source, sharded per JAX process.

The global order is fixed by the seed alone: epoch e visits the examples in a seeded
permutation, cut into global batches of `global_batch_size` (the remainder is dropped).
Process p of P reads rows [p*b, (p+1)*b) of every global batch, b = global_batch_size / P,
so the global batch at step s is the same examples in the same order on any topology. The
iterator's state is the number of batches consumed: a resumed run (on any number of
processes) continues with exactly the batches an uninterrupted one would see.
"""

import grain
import numpy as np

from lambjax.data import masking
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
    read_threads: int = 16,
) -> BatchIterator:
    """An iterator over this process's rows of each global batch (see module docstring).

    `read_threads` threads read examples ahead of the consumer (0: synchronous reads).
    """
    if split not in prepared.data_sources:
        raise DataError(f"split {split!r} was not built; available: {list(prepared.data_sources)}")
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise DataError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"number of processes ({process_count})"
        )
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must lie in [0, {process_count})")
    source = prepared.data_sources[split]
    num_examples = len(source)
    batches_per_epoch = num_examples // global_batch_size
    local_batch = global_batch_size // process_count
    epochs = _UNBOUNDED_EPOCHS if num_epochs is None else num_epochs
    num_batches = batches_per_epoch * epochs
    options = masking.MaskingOptions(
        vocab_size=prepared.vocab_size,
        mask_id=prepared.special_ids["mask"],
        special_ids=tuple(sorted(set(prepared.special_ids.values()))),
        max_predictions_per_seq=max_predictions_per_seq,
        masked_lm_prob=prepared.data_config["masked_lm_prob"],
        continuation_ids=prepared.continuation_ids,
        whole_word_masking=prepared.data_config["whole_word_masking"],
    )
    seq_len = prepared.max_seq_length
    pad_id = prepared.special_ids["pad"]
    permutations: dict[int, np.ndarray] = {}

    def global_position(local_index: int) -> tuple[int, int]:
        """This process's local element -> (epoch, example index in the source)."""
        step, row = divmod(local_index, local_batch)
        position = step * global_batch_size + process_index * local_batch + row
        epoch, offset = divmod(position, batches_per_epoch * global_batch_size)
        if epoch not in permutations:
            permutations.clear()  # one epoch at a time is enough
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(num_examples)
        return epoch, int(permutations[epoch][offset])

    def read(local_index: int) -> dict:
        epoch, index = global_position(local_index)
        example = source[index]
        ids = np.full(seq_len, pad_id, np.int32)
        segments = np.zeros(seq_len, np.int32)
        length = len(example["input_ids"])
        ids[:length] = example["input_ids"]
        segments[:length] = example["segment_ids"]
        return {
            "input_ids": ids,
            "segment_ids": segments,
            "length": np.int32(length),
            "next_sentence_labels": np.int32(example["next_sentence_label"]),
            "epoch": np.int64(epoch),
            "index": np.int64(index),
        }

    def mask(batch: dict) -> dict:
        masked = masking.mask_batch(
            batch["input_ids"], batch["length"], batch["epoch"], batch["index"], seed, options
        )
        input_mask = (np.arange(seq_len)[None] < batch["length"][:, None]).astype(np.int32)
        return {
            **masked,
            "input_mask": input_mask,
            "segment_ids": batch["segment_ids"],
            "next_sentence_labels": batch["next_sentence_labels"],
        }

    def make(start_step: int):
        if batches_per_epoch == 0:
            return iter(())
        dataset = (
            grain.MapDataset.range(start_step * local_batch, num_batches * local_batch)
            .map(read)
            .batch(local_batch, drop_remainder=True)
            .map(mask)
        )
        # Threads read (and mask) ahead of the training step; 0 reads synchronously.
        options = grain.ReadOptions(
            num_threads=read_threads, prefetch_buffer_size=4 * local_batch if read_threads else 0
        )
        return iter(dataset.to_iter_dataset(options))

    return BatchIterator(make, batches_per_epoch, num_batches)
