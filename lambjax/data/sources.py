"""Where pretraining text comes from: `config.data.source`, cut into units of work.

embedded          CPython's pydoc_data.topics (~465K characters of English; every Python
                  ships it, so the demo and tests run offline). One document per topic.
text:GLOB         text files, local or gs://; documents are separated by blank lines.
                  Files compressed with gzip, bzip2 or xz (by suffix .gz/.bz2/.xz, or by
                  their first bytes) are read decompressed; CRLF (and a lone CR) reads as
                  LF; bytes that are not UTF-8 read as U+FFFD and are counted (a file with
                  more than 1% of them is not text, and is skipped); a line longer than
                  MAX_LINE_CHARS is cut at spaces into pieces, each a document.
tfds:NAME[:SPLIT] any TFDS dataset with a text feature (default split: train), read
                  through TFDS from its data dir (it must already be prepared there).

The build works on `Unit`s, each read on its own by one worker (Google's
create_pretraining_data runs once per input file, for the same reason): a text file is one
unit, a file larger than `unit_bytes` is cut into byte ranges whose edges move forward to
the next document boundary (the position after a blank line, "\\n\\n"), a compressed file
is one unit whatever its size (a compressed stream cannot be cut by byte range: a large
corpus is best several compressed files), and a `tfds:` split is cut into record ranges of
about `unit_bytes` of data. A unit owns the documents that
start inside its range, so the units cover every document exactly once. Every path goes
through etils' epath, which reads gs:// as well as local disk.
"""

import bz2
import dataclasses
import gzip
import hashlib
import lzma
import math
import os
import re

from absl import logging
from etils import epath

_GLOB_CHARS = re.compile(r"[*?\[]")
_BOUNDARIES = (b"\n\n", b"\n\r\n")  # a blank line, LF or CRLF
_READ_AHEAD = 1 << 16  # bytes read past a range's end to find the next boundary

# A line longer than this is cut: about 4,000 WordPiece tokens, 8 times the longest sequence
# BERT trains on; longer "sentences" are truncated in the examples anyway, and a corpus of
# one-line documents (a dump without line breaks) would otherwise make sentences of
# megabytes.
MAX_LINE_CHARS = 20_000
# A unit with more undecodable bytes than this share is not text (a binary file): skipped.
MAX_UNDECODABLE_SHARE = 0.01
# The counts of a read that repaired rather than skipped (lambjax.data.builder.summary_line).
REPLACED_BYTES = "bytes not UTF-8 replaced"
SPLIT_LINES = "long lines cut"
REPAIRS = (REPLACED_BYTES, SPLIT_LINES)
# Compression by file suffix, and by the format's first bytes (its magic number).
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}
_COMPRESSION_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}
_DECOMPRESSORS = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}
_SURROGATES = re.compile("[\udc80-\udcff]")  # undecodable bytes, as surrogateescape keeps them


class DataError(ValueError):
    """Bad data input (path, corpus, vocabulary); the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of work: a text file's byte range, or a TFDS split's record range."""

    index: int
    kind: str  # "embedded" | "text" | "tfds"
    path: str = ""  # text: the file; tfds: NAME[:SPLIT]
    start: int = 0  # text: byte offset; tfds: record index
    end: int = 0  # exclusive
    size_bytes: int = 0  # of text, or an estimate for tfds (progress and MB/s)
    tfds_data_dir: str | None = None
    compression: str = ""  # text: gzip | bzip2 | xz, the whole file; "" plain


def check_source(source: str) -> None:
    if source != "embedded" and not source.startswith(("text:", "tfds:")):
        raise DataError(
            f"config.data.source={source!r} is not a known source; valid: 'embedded', "
            "'text:GLOB', 'tfds:NAME[:SPLIT]'"
        )


def list_units(source: str, *, unit_bytes: int, tfds_data_dir: str | None = None) -> list[Unit]:
    """The source's units of work, in a fixed order (the shard order of the build)."""
    check_source(source)
    if source == "embedded":
        return [Unit(0, "embedded", size_bytes=sum(len(d.encode()) for d in _embedded()))]
    if source.startswith("text:"):
        return _text_units(source[len("text:") :], unit_bytes)
    return _tfds_units(source[len("tfds:") :], unit_bytes, tfds_data_dir)


def read_unit(unit: Unit) -> tuple[list[str], dict[str, int]]:
    """(documents of `unit`, skipped counts by reason)."""
    if unit.kind == "embedded":
        return _embedded(), {}
    if unit.kind == "text":
        return _read_text_range(unit)
    return _read_tfds_range(unit), {}


def read_documents(source: str, *, tfds_data_dir: str | None = None) -> tuple[list[str], dict]:
    """Every document of a (small) source in one list, with skipped counts by reason."""
    documents, skipped = [], {}
    for unit in list_units(source, unit_bytes=1 << 62, tfds_data_dir=tfds_data_dir):
        unit_documents, unit_skipped = read_unit(unit)
        documents += unit_documents
        for reason, count in unit_skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return documents, skipped


def fingerprint(source: str, *, tfds_data_dir: str | None = None) -> str:
    """Identifies the source's content cheaply (paths, sizes, mtimes) for build reuse."""
    digest = hashlib.sha256(source.encode())
    if source.startswith("text:"):
        for path in _glob(source[len("text:") :]):
            stat = path.stat()
            digest.update(f"{path}:{stat.length}:{stat.mtime}".encode())
    elif source.startswith("tfds:"):
        digest.update(str(tfds_data_dir).encode())
    return digest.hexdigest()


def _embedded() -> list[str]:
    from pydoc_data import topics

    return [text for _, text in sorted(topics.topics.items()) if text.strip()]


def _glob(pattern: str) -> list[epath.Path]:
    """Files matching `pattern` (`**` recurses), sorted; the fixed part may be gs://."""
    pattern = os.path.expanduser(pattern)
    match = _GLOB_CHARS.search(pattern)
    if match is None:
        path = epath.Path(pattern)
        return [path] if path.is_file() else []
    base, _, _ = pattern[: match.start()].rpartition("/")
    rest = pattern[len(base) + 1 :] if base else pattern
    root = epath.Path(base or ("/" if pattern.startswith("/") else "."))
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob(rest) if p.is_file()), key=str)


def _text_units(pattern: str, unit_bytes: int) -> list[Unit]:
    paths = _glob(pattern)
    if not paths:
        raise DataError(f"text:{pattern} matches no files")
    units = []
    for path in paths:
        size = path.stat().length
        compression = compression_of(path)
        if compression:
            units.append(Unit(len(units), "text", str(path), 0, size, size, None, compression))
            continue
        pieces = max(1, math.ceil(size / unit_bytes))
        edges = [size * i // pieces for i in range(pieces + 1)]
        for start, end in zip(edges[:-1], edges[1:], strict=True):
            units.append(Unit(len(units), "text", str(path), start, end, end - start))
    return units


def compression_of(path: epath.Path) -> str:
    """gzip, bzip2 or xz by the file's suffix, else by its first bytes; "" for plain text."""
    if path.suffix in _COMPRESSION_SUFFIXES:
        return _COMPRESSION_SUFFIXES[path.suffix]
    with path.open("rb") as f:
        head = f.read(6)
    return next((name for magic, name in _COMPRESSION_MAGIC.items() if head.startswith(magic)), "")


def _read_text_range(unit: Unit) -> tuple[list[str], dict[str, int]]:
    if unit.compression:
        try:
            with epath.Path(unit.path).open("rb") as f:
                raw = _DECOMPRESSORS[unit.compression](f).read()
        except (OSError, EOFError, lzma.LZMAError) as e:
            logging.warning("Skipping %s: not readable as %s (%s)", unit.path, unit.compression, e)
            return [], {f"files not readable as {unit.compression}": 1}
        begin, finish = 0, unit.size_bytes
    else:
        with epath.Path(unit.path).open("rb") as f:
            begin = _next_boundary(f, unit.start)
            finish = _next_boundary(f, unit.end)
            f.seek(begin)
            raw = f.read(max(0, finish - begin))
    return text_documents(raw, f"{unit.path} [{begin}:{finish}]")


def text_documents(raw: bytes, where: str = "text") -> tuple[list[str], dict[str, int]]:
    """The documents of raw text (separated by blank lines), repaired as the module doc
    says, with the counts of what was repaired or skipped by reason."""
    text = raw.decode("utf-8", errors="surrogateescape")
    counts = {}
    undecodable = len(_SURROGATES.findall(text))
    if undecodable:
        if undecodable > MAX_UNDECODABLE_SHARE * len(raw):
            logging.warning("Skipping %s: not UTF-8 (%d undecodable bytes)", where, undecodable)
            return [], {"files not UTF-8": 1}
        text = _SURROGATES.sub("\ufffd", text)
        counts[REPLACED_BYTES] = undecodable
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    documents = []
    for document in text.split("\n\n"):
        if not document.strip():
            continue
        if len(document) > MAX_LINE_CHARS:
            pieces, cut = _split_long_lines(document)
            if cut:
                counts[SPLIT_LINES] = counts.get(SPLIT_LINES, 0) + cut
            documents += pieces
        else:
            documents.append(document)
    return documents, counts


def _split_long_lines(document: str) -> tuple[list[str], int]:
    """`document` with each line over MAX_LINE_CHARS cut at its last space before the limit
    (or at the limit, without one): the lines before a long line, each of its pieces and the
    lines after it become documents of their own. A line that long has no sentence ends to
    pair sentences by, and its pieces are its sentences. Also returns the lines cut."""
    documents, lines, cut_lines = [], [], 0
    for line in document.split("\n"):
        if len(line) <= MAX_LINE_CHARS:
            lines.append(line)
            continue
        if "".join(lines).strip():
            documents.append("\n".join(lines))
        lines, cut_lines = [], cut_lines + 1
        while len(line) > MAX_LINE_CHARS:
            cut = line.rfind(" ", 0, MAX_LINE_CHARS + 1)
            cut = cut if cut > 0 else MAX_LINE_CHARS
            documents.append(line[:cut])
            line = line[cut:].lstrip(" ")
        lines.append(line)
    if "".join(lines).strip():
        documents.append("\n".join(lines))
    return documents, cut_lines


def _next_boundary(f, offset: int) -> int:
    """The first document start at or after `offset`: 0, a position just after "\\n\\n",
    or the end of the file."""
    if offset == 0:
        return 0
    position, carry = max(0, offset - 2), b""
    f.seek(position)  # a "\n\n" ending at `offset` makes `offset` itself a boundary
    while True:
        chunk = f.read(_READ_AHEAD)
        if not chunk:
            return position + len(carry)
        window = carry + chunk
        found = [(window.find(b), len(b)) for b in _BOUNDARIES if window.find(b) >= 0]
        if found:
            return position + sum(min(found))
        carry = window[-2:]  # a boundary may straddle two reads
        position += len(window) - len(carry)


def _tfds_builder(spec: str, data_dir: str | None):
    import tensorflow_datasets as tfds

    name, _, split = spec.partition(":")
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
    if (split or "train") not in builder.info.splits:
        raise DataError(
            f"tfds:{spec}: dataset {name!r} has no split {split or 'train'!r}; "
            f"splits: {sorted(builder.info.splits)}"
        )
    return builder, split or "train", "text" if "text" in text_keys else text_keys[0]


def _tfds_units(spec: str, unit_bytes: int, data_dir: str | None) -> list[Unit]:
    builder, split, _ = _tfds_builder(spec, data_dir)
    info = builder.info.splits[split]
    records, total_bytes = info.num_examples, max(1, info.num_bytes)
    per_unit = max(1, math.ceil(records * unit_bytes / total_bytes)) if records else 1
    units = []
    for start in range(0, records, per_unit):
        end = min(records, start + per_unit)
        estimate = total_bytes * (end - start) // max(1, records)
        units.append(Unit(len(units), "tfds", spec, start, end, estimate, data_dir))
    if not units:
        raise DataError(f"tfds:{spec}: split {split!r} holds no records")
    return units


def _read_tfds_range(unit: Unit) -> list[str]:
    import tensorflow_datasets as tfds

    builder, split, key = _tfds_builder(unit.path, unit.tfds_data_dir)
    dataset = builder.as_dataset(split=f"{split}[{unit.start}:{unit.end}]", shuffle_files=False)
    return [
        example[key].decode("utf-8") for example in tfds.as_numpy(dataset) if example[key].strip()
    ]
