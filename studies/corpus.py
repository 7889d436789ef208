"""The CPU studies' real-text corpus: the Linux kernel's documentation, from Debian's
`linux-doc-6.1` package (3,184 reStructuredText sources, ~24 MB of English prose about
the kernel), written as text files that `--config.data.source=text:DIR/*.txt` reads.

  apt-get download linux-doc-6.1        # any Debian mirror; a .deb of ~37 MB
  python -m studies.corpus linux-doc-6.1_*.deb ~/data/linux-doc

Each source file becomes one document: its blank lines are dropped (the text reader
separates documents at blank lines) and so are the lines that only underline or overline a
heading ("=====", "-----") and the license tags (".. SPDX-License-Identifier: ..."), which
are markup, not text. Documents are written in the order
of their paths, to SHARDS files of about equal size, so that the build has units to share
out and the corpus is the same bytes on every machine. The package's version (6.1.176-1
when the studies were run) is printed with the counts; another version gives another
corpus, and the study's write-up names the one it used.
"""

import os
import re
import subprocess
import sys
import tempfile

SOURCES = "usr/share/doc/linux-doc-6.1/html/_sources"
SHARDS = 8
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_LICENSE_TAG = re.compile(r"^\.\.\s+SPDX-License-Identifier:")


def document(text: str) -> str:
    """One source file as one document: no blank lines, no heading adornments."""
    lines = (line.rstrip() for line in text.splitlines())
    return "\n".join(
        line
        for line in lines
        if line.strip() and not _ADORNMENT.match(line) and not _LICENSE_TAG.match(line)
    )


def sources(root: str) -> list[str]:
    paths = []
    for folder, _, files in os.walk(root):
        paths += [os.path.join(folder, f) for f in files if f.endswith(".txt")]
    return sorted(paths)


def write_corpus(root: str, out: str, shards: int = SHARDS) -> dict:
    """The documents under `root` into `shards` text files in `out`; returns the counts."""
    documents = []
    for path in sources(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = document(f.read())
        if text:
            documents.append(text)
    if not documents:
        raise SystemExit(f"no .txt sources under {root}: is it linux-doc's {SOURCES}?")
    os.makedirs(out, exist_ok=True)
    existing = [f for f in os.listdir(out) if f.startswith("linux-doc-")]
    if existing:
        raise SystemExit(
            f"{out} already holds {len(existing)} linux-doc-*.txt files; name an empty folder"
        )
    total = sum(len(d) for d in documents)
    shard, written = 0, 0
    files = [
        open(os.path.join(out, f"linux-doc-{i:02d}.txt"), "w", encoding="utf-8")
        for i in range(shards)
    ]
    try:
        for text in documents:
            shard = min(shards - 1, written * shards // total)
            files[shard].write(text + "\n\n")
            written += len(text)
    finally:
        for f in files:
            f.close()
    return {"documents": len(documents), "characters": total, "files": shards}


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    deb, out = argv[1], argv[2]
    if not os.path.isfile(deb):
        raise SystemExit(f"{deb}: no such .deb (apt-get download linux-doc-6.1 gives one)")
    version = subprocess.run(
        ["dpkg-deb", "--field", deb, "Version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True)
        counts = write_corpus(os.path.join(tmp, SOURCES), out)
    print(
        f"linux-doc-6.1 {version}: {counts['documents']} documents, "
        f"{counts['characters']:,} characters in {counts['files']} files under {out}"
    )


if __name__ == "__main__":
    main(sys.argv)
