"""SQuAD- and GLUE-format files generated from the embedded corpus (no download).

SQuAD: a run of corpus words with a name put in after a word; the question asks which name
comes after that word, the answer is the name at its character offset. GLUE (SST-2's TSV): a
corpus sentence with a positive or a negative word put in; the label says which. Both are
learnable by a tiny BERT from scratch in a hundred steps, and their trivial baselines are far
lower (a fixed span; the majority class).
"""

import json
import re

import numpy as np

POSITIVE = ("wonderful", "excellent", "delightful", "superb")
NEGATIVE = ("terrible", "dreadful", "horrible", "awful")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")


def corpus_words() -> list[str]:
    from pydoc_data import topics

    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    return re.findall(r"[A-Za-z]+(?:'[a-z]+)?|[.,;:]", text)


def squad_data(num_questions: int, seed: int, *, context_words=40, version_2=False) -> dict:
    """A SQuAD file's JSON ({"version", "data"}). Each context is a run of corpus words with
    a name put in after a word W; the question asks for the name after W, the answer is the
    name at its character offset. v2.0 leaves the name out of every third context (the
    question is then unanswerable)."""
    words = corpus_words()
    rng = np.random.default_rng(seed)
    paragraphs = []
    while len(paragraphs) < num_questions:
        start = int(rng.integers(0, len(words) - context_words))
        tokens = words[start : start + context_words]
        i = int(rng.integers(0, context_words - 1))
        if not tokens[i].isalpha():
            continue
        qid = f"q{len(paragraphs)}"
        question = f"which name comes after {tokens[i]} ?"
        unanswerable = version_2 and len(paragraphs) % 3 == 2
        name = str(rng.choice(NAMES))
        if not unanswerable:
            tokens.insert(i + 1, name)
        context = " ".join(tokens)
        offset = len(" ".join(tokens[: i + 1])) + 1
        answers = [] if unanswerable else [{"text": name, "answer_start": offset}]
        qa = {"id": qid, "question": question, "answers": answers}
        if version_2:
            qa["is_impossible"] = unanswerable
        paragraphs.append({"context": context, "qas": [qa]})
    return {
        "version": "v2.0" if version_2 else "1.1",
        "data": [{"title": "generated", "paragraphs": paragraphs}],
    }


def write_squad(path, *args, **kwargs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(squad_data(*args, **kwargs), f)
    return str(path)


def sst2_rows(num: int, seed: int) -> list[tuple[str, int]]:
    words = [w for w in corpus_words() if w.isalpha()]
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num):
        start = int(rng.integers(0, len(words) - 12))
        sentence = words[start : start + 10]
        label = int(rng.integers(0, 2))
        sentiment = rng.choice(POSITIVE if label else NEGATIVE)
        sentence.insert(int(rng.integers(0, 10)), str(sentiment))
        rows.append((" ".join(sentence).lower(), label))
    return rows


def write_sst2(path, num: int, seed: int) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tlabel\n")
        f.writelines(f"{s}\t{label}\n" for s, label in sst2_rows(num, seed))
    return str(path)
