"""`text:` corpora as people have them: compressed (gzip, bzip2, xz, by suffix or by their
first bytes), with CRLF line ends, stray bytes that are not UTF-8 and very long lines; the
Beam build reads them through the same function (lambjax.data.sources.read_unit)."""

import bz2
import gzip
import lzma

import pytest

from lambjax import data
from lambjax.data import builder as builder_lib
from lambjax.data import sources
from tests.data.test_data import _documents, config

COMPRESSORS = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}
SUFFIXES = {"gzip": ".gz", "bzip2": ".bz2", "xz": ".xz"}


def read(pattern: str, unit_bytes: int = 1 << 30) -> tuple[list[str], dict]:
    documents, counts = [], {}
    for unit in sources.list_units(f"text:{pattern}", unit_bytes=unit_bytes):
        unit_documents, unit_counts = sources.read_unit(unit)
        documents += unit_documents
        for reason, n in unit_counts.items():
            counts[reason] = counts.get(reason, 0) + n
    return documents, counts


@pytest.mark.parametrize("kind", list(COMPRESSORS))
@pytest.mark.parametrize("named", [True, False], ids=["by_suffix", "by_magic_bytes"])
def test_compressed_files_read_as_their_text(tmp_path, kind, named):
    text = _documents(20)
    (tmp_path / "plain.txt").write_text(text)
    name = f"corpus.txt{SUFFIXES[kind]}" if named else "corpus.txt"
    compressed = tmp_path / "packed" / name
    compressed.parent.mkdir()
    compressed.write_bytes(COMPRESSORS[kind](text.encode()))
    units = sources.list_units(f"text:{compressed}", unit_bytes=64)  # one unit all the same
    assert len(units) == 1 and units[0].compression == kind
    assert read(str(compressed)) == read(str(tmp_path / "plain.txt"))
    assert len(read(str(compressed))[0]) == 20


def test_a_truncated_compressed_file_is_skipped_and_counted(tmp_path):
    packed = gzip.compress(_documents(20).encode())
    (tmp_path / "cut.txt.gz").write_bytes(packed[: len(packed) // 2])
    documents, counts = read(str(tmp_path / "cut.txt.gz"))
    assert documents == [] and counts == {"files not readable as gzip": 1}


def test_crlf_and_cr_read_as_lf_and_byte_ranges_still_cover_every_document_once(tmp_path):
    text = _documents(40)
    (tmp_path / "lf.txt").write_text(text)
    (tmp_path / "crlf.txt").write_bytes(text.replace("\n", "\r\n").encode())
    (tmp_path / "cr.txt").write_bytes(text.replace("\n", "\r").encode())
    expected, _ = read(str(tmp_path / "lf.txt"))
    assert len(expected) == 40
    assert read(str(tmp_path / "cr.txt"))[0] == expected
    for unit_bytes in (1 << 30, 300, 97):  # cut into ranges at CRLF blank lines
        assert read(str(tmp_path / "crlf.txt"), unit_bytes)[0] == expected


def test_stray_bytes_are_replaced_and_counted_a_binary_file_is_skipped(tmp_path):
    text = _documents(20).encode()
    stray = text[:500] + b"caf\xe9 \xff\xfe" + text[500:]
    (tmp_path / "stray.txt").write_bytes(stray)
    documents, counts = read(str(tmp_path / "stray.txt"))
    assert counts == {sources.REPLACED_BYTES: 3}
    assert "caf\ufffd \ufffd\ufffd" in "\n\n".join(documents)
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8)
    assert read(str(tmp_path / "binary.bin")) == ([], {"files not UTF-8": 1})


def test_overlong_lines_are_cut_into_documents(tmp_path):
    limit = sources.MAX_LINE_CHARS
    words = " ".join(f"w{i}" for i in range(limit))  # about 6.4 limits, no sentence end
    (tmp_path / "long.txt").write_text(f"Short first line.\n{words}\nLast.\n\nNext document.")
    documents, counts = read(str(tmp_path / "long.txt"))
    pieces = -(-len(words) // limit)
    assert counts == {sources.SPLIT_LINES: 1}
    assert documents[0] == "Short first line." and documents[-1] == "Next document."
    assert documents[-2].endswith("\nLast.") and len(documents) == 2 + pieces
    assert all(len(d) <= limit for d in documents)
    cut = documents[1:-1]
    cut[-1] = cut[-1].removesuffix("\nLast.")
    assert " ".join(cut) == words  # cut at spaces, nothing lost


def test_the_beam_build_reads_messy_text_and_the_summary_counts_the_repairs(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt.gz").write_bytes(gzip.compress(_documents(30, seed=1).encode()))
    crlf = _documents(30, seed=2).replace("\n", "\r\n").encode()
    (corpus / "b.txt").write_bytes(crlf[:200] + b"\xff" + crlf[200:])
    (corpus / "c.txt.xz").write_bytes(lzma.compress(_documents(30, seed=3).encode()))
    summaries = []
    c = config(tmp_path / "out", source=f"text:{corpus}/*", vocab_size=200)
    prepared = data.prepare_all(
        c, [64], beam_options="direct_num_workers=1", on_summary=summaries.append
    )[64]
    assert summaries[0].documents == 90 and prepared.num_examples("train") > 0
    assert summaries[0].skipped == {sources.REPLACED_BYTES: 1}
    line = builder_lib.summary_line(summaries[0], c.data_dir)
    assert "(skipped: none; repaired: 1 bytes not UTF-8 replaced)" in line
