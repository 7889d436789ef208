"""A prepared TFDS split as a fine-tuning source (`tfds:NAME:SPLIT`), for GLUE and SQuAD."""

from lambjax.finetune.errors import FinetuneError


def tfds_rows(source: str, data_dir, example: str):
    """(the builder, its rows as numpy) of `tfds:NAME:SPLIT`; `example` shows the syntax."""
    import tensorflow_datasets as tfds

    name, _, split = source[len("tfds:") :].rpartition(":")
    if not name:
        raise FinetuneError(f"{source!r}: write tfds:NAME:SPLIT, e.g. {example}")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # noqa: BLE001 - TFDS raises many kinds for an unknown name
        raise FinetuneError(f"{source}: cannot open {name!r}: {e}".splitlines()[0]) from e
    if not builder.is_prepared():
        raise FinetuneError(f"{source}: not prepared under {builder.data_dir}; run `tfds build`")
    return builder, tfds.as_numpy(builder.as_dataset(split=split))
