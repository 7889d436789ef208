"""The studies' real-text corpus (studies/corpus.py): one document per source file, markup
lines dropped, shards in path order, and nothing written over."""

import pytest

from lambjax.data import sources
from studies import corpus


def test_a_source_file_becomes_one_document_without_its_markup_lines():
    text = (
        ".. SPDX-License-Identifier: GPL-2.0\n"
        "=============\n"
        "The Title\n"
        "=============\n"
        "\n"
        "First paragraph,\n"
        "wrapped.\n"
        "\n"
        "Section\n"
        "-------\n"
        "  Indented text.   \n"
    )
    assert corpus.document(text) == (
        "The Title\nFirst paragraph,\nwrapped.\nSection\n  Indented text."
    )


def test_the_corpus_reads_back_as_one_document_per_file(tmp_path):
    root = tmp_path / "sources"
    for name, body in [("b/two.rst.txt", "Two.\n\nMore two."), ("a/one.rst.txt", "One.")]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    (root / "a" / "image.png").write_bytes(b"\x89PNG")  # not a source: skipped
    counts = corpus.write_corpus(str(root), str(tmp_path / "out"), shards=2)
    assert counts == {
        "documents": 2,
        "characters": len("One.") + len("Two.\nMore two."),
        "files": 2,
    }
    documents, _ = sources.read_documents(f"text:{tmp_path}/out/*.txt")
    assert documents == ["One.", "Two.\nMore two."]  # path order, blank lines gone

    with pytest.raises(SystemExit, match="already holds 2 linux-doc-\\*.txt files"):
        corpus.write_corpus(str(root), str(tmp_path / "out"), shards=2)


def test_a_missing_package_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no such .deb"):
        corpus.main(["corpus", str(tmp_path / "missing.deb"), str(tmp_path / "out")])
