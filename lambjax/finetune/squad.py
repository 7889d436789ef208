"""SQuAD v1.1 / v2.0: reading, features over a sliding window, and answers from span logits.

Features follow Google BERT's run_squad.py: `[CLS] question [SEP] context window [SEP]`, the
question cut to `max_query_length` tokens, the context covered by windows of what is left of
`max_seq_length` that start `doc_stride` tokens apart. A training window that does not hold
the whole answer (or a v2.0 question without one) points both labels at [CLS]. An answer
maps to tokens through the tokenizer's character offsets, so a predicted span is read back
from the original context, its case and spacing intact.

Predictions: per feature, the `n_best_size` best starts and ends over the window; a span is
kept if it lies in the context, starts at a token whose window gives it the most context,
and is at most `max_answer_length` tokens long. The best span over an example's windows is
its answer; for v2.0 the null score is [CLS]'s start + end logit (the lowest over the
windows), its odds against the best span are `null_odds`, and the answer is "" where the
odds exceed `null_score_diff_threshold`.
"""

import dataclasses
import json

import numpy as np

from lambjax.finetune import sources
from lambjax.finetune.errors import FinetuneError


@dataclasses.dataclass(frozen=True)
class Example:
    qid: str
    question: str
    context: str
    answer_start: int  # character offset of the (first) answer; -1: none (v2.0 or eval)
    answer_text: str


# ----------------------------------------------------------------------------------------
# Reading


def read(source: str, *, version_2: bool, training: bool, tfds_data_dir=None):
    """(examples, the SQuAD `data` list for scoring) of a JSON file or `tfds:NAME:SPLIT`."""
    data = _read_tfds(source, tfds_data_dir) if source.startswith("tfds:") else _read_json(source)
    return examples_from_data(data, source, version_2=version_2, training=training), data


def _read_json(path: str) -> list:
    from etils import epath

    path_obj = epath.Path(path)
    if not path_obj.exists():
        raise FinetuneError(f"SQuAD file {path!r}: no such file")
    try:
        dataset = json.loads(path_obj.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FinetuneError(f"SQuAD file {path!r} is not valid JSON: {e}") from e
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise FinetuneError(f"SQuAD file {path!r} has no 'data' list: not SQuAD's JSON format")
    return dataset["data"]


def _read_tfds(source: str, data_dir) -> list:
    """A prepared TFDS SQuAD split as SQuAD's `data` list (one article per paragraph)."""
    _, rows = sources.tfds_rows(source, data_dir, "tfds:squad/v1.1:validation")
    data = []
    for row in rows:
        answers = row["answers"]
        qa = {
            "id": row["id"].decode(),
            "question": row["question"].decode(),
            "answers": [
                {"text": t.decode(), "answer_start": int(s)}
                for t, s in zip(answers["text"], answers["answer_start"], strict=True)
            ],
        }
        if "is_impossible" in row:
            qa["is_impossible"] = bool(row["is_impossible"])
        data.append(
            {"title": "", "paragraphs": [{"context": row["context"].decode(), "qas": [qa]}]}
        )
    return data


def examples_from_data(data: list, source: str, *, version_2: bool, training: bool) -> list:
    """Examples of a SQuAD `data` list; training answers are checked against their offsets."""
    examples = []
    try:
        for article in data:
            for paragraph in article["paragraphs"]:
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    examples.append(_example(qa, context, source, version_2, training))
    except (KeyError, TypeError) as e:
        raise FinetuneError(
            f"SQuAD file {source!r}: an article, paragraph or question lacks a SQuAD field "
            f"({type(e).__name__}: {e})"
        ) from e
    if not examples:
        raise FinetuneError(f"SQuAD file {source!r} holds no questions")
    return examples


def _example(qa: dict, context: str, source: str, version_2: bool, training: bool) -> Example:
    answers = qa["answers"]
    impossible = qa.get("is_impossible", False) or not answers
    if impossible and not version_2 and training:
        raise FinetuneError(
            f"SQuAD file {source!r}: question {qa['id']!r} has no answer, which only SQuAD "
            "v2.0 allows (use configs/finetune/squad.py:v2)"
        )
    if not training or impossible:
        return Example(qa["id"], qa["question"], context, -1, "")
    start, text = int(answers[0]["answer_start"]), answers[0]["text"]
    if context[start : start + len(text)] != text:
        raise FinetuneError(
            f"SQuAD file {source!r}: question {qa['id']!r}: answer {text!r} is not at its "
            f"answer_start={start} (the context there reads "
            f"{context[start : start + len(text)]!r})"
        )
    return Example(qa["id"], qa["question"], context, start, text)


# ----------------------------------------------------------------------------------------
# Features


@dataclasses.dataclass
class Features:
    arrays: dict  # input_ids, segment_ids, input_mask [N, S]; start/end_positions [N]
    example_index: np.ndarray  # [N] which example each window belongs to
    offsets: np.ndarray  # [N, S, 2] character span of each context token; -1 elsewhere
    max_context: np.ndarray  # [N, S] the token has its most context in this window

    def __len__(self):
        return len(self.example_index)


def windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of the context windows, as run_squad.py places them."""
    spans, start = [], 0
    while True:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, doc_stride)


def best_windows(spans, num_tokens: int) -> np.ndarray:
    """For each context token, the window that gives it the most context (run_squad.py's
    min(left, right) + 0.01 * length score; the first window wins a tie)."""
    position = np.arange(num_tokens)
    scores = np.full((len(spans), num_tokens), -np.inf)
    for i, (start, length) in enumerate(spans):
        end = start + length - 1
        inside = (position >= start) & (position <= end)
        score = np.minimum(position - start, end - position) + 0.01 * length
        scores[i] = np.where(inside, score, -np.inf)
    return np.argmax(scores, axis=0)


def _answer_tokens(example: Example, offsets) -> tuple[int, int] | None:
    """First and last context token of the answer's characters."""
    start, end = example.answer_start, example.answer_start + len(example.answer_text)
    inside = [i for i, (s, e) in enumerate(offsets) if e > start and s < end]
    return (inside[0], inside[-1]) if inside else None


def featurize(
    examples: list,
    tokenizer,
    special: dict,
    *,
    max_seq_length: int,
    doc_stride: int,
    max_query_length: int,
    training: bool,
) -> Features:
    """Windows of every example (tokenizer: a `tokenizers` BERT tokenizer, no padding)."""
    max_tokens = max_seq_length - min(max_query_length, max_seq_length) - 3
    if max_tokens <= 0 or doc_stride <= 0:
        raise FinetuneError(
            f"max_seq_length={max_seq_length} leaves no room for the context after "
            f"max_query_length={max_query_length} (and doc_stride={doc_stride} must be > 0)"
        )
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    contexts = tokenizer.encode_batch([e.context for e in examples], add_special_tokens=False)
    rows = {
        k: []
        for k in ("input_ids", "segment_ids", "input_mask", "start_positions", "end_positions")
    }
    example_index, all_offsets, max_context = [], [], []
    for index, (example, question, context) in enumerate(
        zip(examples, questions, contexts, strict=True)
    ):
        query = question.ids[:max_query_length]
        answer = _answer_tokens(example, context.offsets) if example.answer_start >= 0 else None
        spans = windows(len(context.ids), max_seq_length - len(query) - 3, doc_stride)
        best = best_windows(spans, len(context.ids))
        for span_index, (start, length) in enumerate(spans):
            ids = [
                special["cls"],
                *query,
                special["sep"],
                *context.ids[start : start + length],
                special["sep"],
            ]
            first = len(query) + 2  # position of the window's first context token
            pad = max_seq_length - len(ids)
            rows["input_ids"].append(ids + [special["pad"]] * pad)
            rows["segment_ids"].append([0] * first + [1] * (length + 1) + [0] * pad)
            rows["input_mask"].append([1] * len(ids) + [0] * pad)
            offsets = np.full((max_seq_length, 2), -1, np.int32)
            offsets[first : first + length] = context.offsets[start : start + length]
            context_flags = np.zeros(max_seq_length, bool)
            context_flags[first : first + length] = best[start : start + length] == span_index
            label = (0, 0)
            if answer is not None and start <= answer[0] and answer[1] < start + length:
                label = (answer[0] - start + first, answer[1] - start + first)
            rows["start_positions"].append(label[0])
            rows["end_positions"].append(label[1])
            example_index.append(index)
            all_offsets.append(offsets)
            max_context.append(context_flags)
    arrays = {k: np.asarray(v, np.int32) for k, v in rows.items()}
    if not training:
        arrays = {k: v for k, v in arrays.items() if "positions" not in k}
    return Features(
        arrays, np.asarray(example_index, np.int32), np.stack(all_offsets), np.stack(max_context)
    )


# ----------------------------------------------------------------------------------------
# Predictions


def predict(
    examples: list,
    features: Features,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    *,
    n_best_size: int,
    max_answer_length: int,
    version_2: bool,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict, dict]:
    """({qid: answer text}, {qid: null odds} (v2.0; else empty)) from per-feature logits."""
    by_example: dict[int, list[int]] = {}
    for feature, index in enumerate(features.example_index):
        by_example.setdefault(int(index), []).append(feature)
    predictions, null_odds = {}, {}
    for index, example in enumerate(examples):
        best_score, best_text = -np.inf, ""
        null_score = np.inf
        for feature in by_example.get(index, []):
            starts, ends = start_logits[feature], end_logits[feature]
            null_score = min(null_score, float(starts[0] + ends[0]))
            offsets, valid = features.offsets[feature], features.max_context[feature]
            top_starts = np.argsort(-starts, kind="stable")[:n_best_size]
            top_ends = np.argsort(-ends, kind="stable")[:n_best_size]
            for s in top_starts:
                if not valid[s]:
                    continue
                for e in top_ends:
                    if offsets[e, 0] < 0 or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(starts[s] + ends[e])
                    if score > best_score:
                        best_score = score
                        best_text = example.context[offsets[s, 0] : offsets[e, 1]]
        if version_2:
            odds = null_score - best_score if np.isfinite(best_score) else np.inf
            null_odds[example.qid] = float(min(odds, 1e9))
            predictions[example.qid] = "" if odds > null_score_diff_threshold else best_text
        else:
            predictions[example.qid] = best_text
    return predictions, null_odds
