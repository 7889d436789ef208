"""Where pretraining text comes from: `config.data.source`.

embedded          CPython's pydoc_data.topics (~465K characters of English; every Python
                  ships it, so the demo and tests run offline). One document per topic.
text:GLOB         local text files; documents are separated by blank lines.
tfds:NAME[:SPLIT] any TFDS dataset with a text feature (default split: train), read
                  through TFDS from its data dir (it must already be prepared there).
"""

import glob
import hashlib
import os

from absl import logging


class DataError(ValueError):
    """Bad data input (path, corpus, vocabulary); the message is one line for the user."""


def read_documents(source: str, *, tfds_data_dir: str | None = None) -> tuple[list[str], dict]:
    """Returns (documents, skipped counts by reason)."""
    if source == "embedded":
        return _embedded(), {}
    if source.startswith("text:"):
        return _text_files(source[len("text:") :])
    if source.startswith("tfds:"):
        return _tfds(source[len("tfds:") :], tfds_data_dir), {}
    raise DataError(
        f"config.data.source={source!r} is not a known source; valid: 'embedded', "
        "'text:GLOB', 'tfds:NAME[:SPLIT]'"
    )


def fingerprint(source: str, *, tfds_data_dir: str | None = None) -> str:
    """Identifies the source's content cheaply (paths, sizes, mtimes) for build reuse."""
    digest = hashlib.sha256(source.encode())
    if source.startswith("text:"):
        for path in sorted(glob.glob(source[len("text:") :], recursive=True)):
            stat = os.stat(path)
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    elif source.startswith("tfds:"):
        digest.update(str(tfds_data_dir).encode())
    return digest.hexdigest()


def _embedded() -> list[str]:
    from pydoc_data import topics

    return [text for _, text in sorted(topics.topics.items()) if text.strip()]


def _text_files(pattern: str) -> tuple[list[str], dict]:
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise DataError(f"text:{pattern} matches no files")
    documents, skipped = [], {}
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            logging.warning("Skipping %s: not UTF-8 (%s)", path, e)
            skipped["files not UTF-8"] = skipped.get("files not UTF-8", 0) + 1
            continue
        documents += [d for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]
    if skipped and not documents:
        raise DataError(f"text:{pattern}: no file could be decoded as UTF-8 ({len(paths)} files)")
    return documents, skipped


def _tfds(spec: str, data_dir: str | None) -> list[str]:
    import tensorflow_datasets as tfds

    name, _, split = spec.partition(":")
    split = split or "train"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # noqa: BLE001 - TFDS raises many kinds for an unknown name
        raise DataError(f"tfds:{spec}: cannot open dataset {name!r}: {e}".splitlines()[0]) from e
    if not builder.is_prepared():
        raise DataError(
            f"tfds:{spec}: dataset {name!r} is not prepared under {builder.data_dir}; "
            "prepare it with `tfds build` first (lambjax never downloads at training time)"
        )
    features = builder.info.features
    text_keys = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
    if not text_keys:
        raise DataError(f"tfds:{spec}: dataset {name!r} has no text feature ({list(features)})")
    key = "text" if "text" in text_keys else text_keys[0]
    dataset = builder.as_dataset(split=split)
    return [
        example[key].decode("utf-8") for example in tfds.as_numpy(dataset) if example[key].strip()
    ]
