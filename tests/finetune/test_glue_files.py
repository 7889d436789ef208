"""Every GLUE task's files as GLUE ships them, read by lambjax.finetune.glue.

The headers are those of the files that GLUE-baselines' download_glue_data.py leaves on
disk: the tasks' zips unpacked as they are (CoLA's train and dev without a header; MNLI's
train with one annotator label, its dev_matched and dev_mismatched with five), and MRPC's
train.tsv and dev.tsv written by `format_mrpc`, which copies the header line of the Microsoft
corpus's msr_paraphrase_train.txt, UTF-8 byte order mark included (TFDS's glue builder,
tensorflow_datasets/text/glue.py `_generate_example_mrpc_files`, skips those 3 bytes). The
column names are the ones TFDS's builder reads (its `text_features` and `label_column`).
"""

import re

import pytest

from lambjax.finetune import glue
from lambjax.finetune.errors import FinetuneError

MNLI_PARSES = "sentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\tsentence2_parse"
HEADERS = {
    "sst2": "sentence\tlabel",
    "mrpc": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
    "stsb": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    "\tscore",
    "qqp": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
    "mnli_train": f"index\tpromptID\tpairID\tgenre\t{MNLI_PARSES}\tsentence1\tsentence2\tlabel1"
    "\tgold_label",
    "mnli_dev": f"index\tpromptID\tpairID\tgenre\t{MNLI_PARSES}\tsentence1\tsentence2\tlabel1"
    "\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
    "qnli": "index\tquestion\tsentence\tlabel",
    "rte": "index\tsentence1\tsentence2\tlabel",
    "wnli": "index\tsentence1\tsentence2\tlabel",
}
PARSES = "( a )\t( b )\t(ROOT a)\t(ROOT b)"


def write(tmp_path, name: str, lines: list[str], newline="\n") -> str:
    path = tmp_path / name
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return str(path)


def read(task_name: str, path: str):
    return glue.read(glue.get_task(task_name), path)


def test_cola_has_no_header(tmp_path):
    path = write(tmp_path, "train.tsv", [
        "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
        "gj04\t0\t*\tThey drank the pub.",
    ])  # fmt: skip
    examples = read("cola", path)
    assert examples.texts[1] == ("They drank the pub.",)
    assert list(examples.labels) == [1, 0]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_mrpc_header_with_its_byte_order_mark(tmp_path, newline):
    path = write(tmp_path, "train.tsv", [
        HEADERS["mrpc"],
        "1\t702876\t702977\tAmrozi accused his brother.\tReferring to him, Amrozi accused him.",
        "0\t2108705\t2108831\tYucaipa owned Dominick's.\tYucaipa bought Dominick's in 1995.",
    ], newline)  # fmt: skip
    assert (tmp_path / "train.tsv").read_bytes()[:3] == b"\xef\xbb\xbf"
    examples = read("mrpc", path)
    assert examples.texts[0] == (
        "Amrozi accused his brother.",
        "Referring to him, Amrozi accused him.",
    )
    assert list(examples.labels) == [1, 0]


def test_single_sentence_and_pair_tasks(tmp_path):
    # task: (the row's fields before the texts, the texts, its label string, the label)
    cases = {
        "sst2": ([], ("hide new secretions from the parental units ",), "0", 0),
        "stsb": (
            ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none"],
            ("A plane is taking off.", "An air plane is taking off."),
            "5.000",
            5.0,
        ),
        "qnli": (["0"], ("What came into force?", "The new constitution."), "entailment", 0),
        "rte": (["0"], ("No arms found in Iraq yet.", "Arms found."), "not_entailment", 1),
        "wnli": (["0"], ("I stuck a pin through a carrot.", "The carrot had a hole."), "1", 1),
    }
    for task, (before, texts, label_text, label) in cases.items():
        row = "\t".join([*before, *texts, label_text])
        examples = read(task, write(tmp_path, f"{task}.tsv", [HEADERS[task], row]))
        assert examples.texts == [texts], task
        assert examples.labels.tolist() == [label], task


def test_mnli_train_and_both_dev_sets(tmp_path):
    """Train has one annotator label, dev_matched and dev_mismatched five; a quote is text
    (the files are unquoted)."""
    train = write(tmp_path, "train.tsv", [
        HEADERS["mnli_train"],
        f'0\t31193\t31193n\tgovernment\t{PARSES}\tHe said "no" twice.\tHe said no.'
        "\tneutral\tneutral",
    ])  # fmt: skip
    examples = read("mnli", train)
    assert examples.texts == [('He said "no" twice.', "He said no.")]
    assert examples.labels.tolist() == [2]
    # A row with a field more than the header is read by the header's positions (as TFDS).
    extra = write(tmp_path, "extra.tsv", [
        HEADERS["mnli_train"],
        f"0\t1\t1n\tfiction\t{PARSES}\tA man.\tA person.\tentailment\tentailment\t",
    ])  # fmt: skip
    assert read("mnli", extra).texts == [("A man.", "A person.")]
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        votes = "entailment\tentailment\tneutral\tentailment\tentailment"
        dev = write(tmp_path, name, [
            HEADERS["mnli_dev"],
            f"0\t63735\t63735n\tslate\t{PARSES}\tThe rights are nice.\tThey are new.\t{votes}"
            "\tentailment",
        ])  # fmt: skip
        assert read("mnli", dev).labels.tolist() == [1]


def test_qqp_rows_broken_over_two_lines_are_skipped(tmp_path, caplog):
    """A question broken by a line break leaves two rows with too few fields; a line
    separator that is not \\n (U+2028, \\x85) stays inside its field."""
    good = [
        f"{i}\t{2 * i}\t{2 * i + 1}\tWhy is q{i}?\tIs q{i}\u2028so?\x85\t{i % 2}"
        for i in range(2000)
    ]
    broken = ["9000\t9001\t9002\tHow do I", "learn?\tHow to learn?\t1"]
    path = write(tmp_path, "train.tsv", [HEADERS["qqp"], *good[:1000], *broken, *good[1000:]])
    examples = read("qqp", path)
    assert len(examples.texts) == 2000
    assert examples.texts[3] == ("Why is q3?", "Is q3\u2028so?\x85")
    assert examples.labels.tolist()[:4] == [0, 1, 0, 1]
    assert "2 of 2002 rows have fewer tab-separated fields than 6" in caplog.text
    assert "line 1002 (4 fields), line 1003 (3 fields)" in caplog.text


def test_a_file_of_another_layout_is_refused_not_skipped(tmp_path):
    rows = [HEADERS["qqp"], *[f"{i}\t1\t2\tq\t0" for i in range(10)]]
    with pytest.raises(FinetuneError, match=re.escape(
        "10 of 10 rows have fewer tab-separated fields than 6: line 2 (5 fields)"
    )):  # fmt: skip
        read("qqp", write(tmp_path, "train.tsv", rows))
