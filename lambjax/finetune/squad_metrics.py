"""SQuAD scoring as the official scripts define it (evaluate-v1.1.py and evaluate-v2.0.py).

v1.1: exact match and F1 of the normalised answer (lower case, punctuation and the articles
a/an/the removed, whitespace collapsed), the maximum over the gold answers; a question with
no prediction scores 0; both in percent over all questions.

v2.0: the same per-question scores, where an unanswerable question's only gold answer is ""
(and two empty token lists match); a question whose no-answer probability exceeds the
threshold counts as predicted unanswerable. Reported over all questions, the answerable
(HasAns) and unanswerable (NoAns) ones, and, given the no-answer odds, at the threshold that
maximises each score (best_exact / best_f1 and their thresholds).

References:
  Rajpurkar et al., "SQuAD: 100,000+ Questions for Machine Comprehension of Text", 2016;
  Rajpurkar et al., "Know What You Don't Know: Unanswerable Questions for SQuAD", 2018.
"""

import collections
import re
import string
import sys

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, articles removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def exact_match_score(prediction: str, gold: str) -> int:
    return int(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of the normalised answers; two empty answers match (v2.0's no-answer)."""
    predicted, gold_tokens = _tokens(prediction), _tokens(gold)
    if not predicted or not gold_tokens:
        return float(predicted == gold_tokens)
    common = collections.Counter(predicted) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def questions(dataset: list) -> list[dict]:
    """Every question (`qa`) of a SQuAD `data` list, in file order."""
    return [
        qa for article in dataset for paragraph in article["paragraphs"] for qa in paragraph["qas"]
    ]


def evaluate_v1(dataset: list, predictions: dict) -> dict:
    """{'exact_match', 'f1'} in percent, as evaluate-v1.1.py prints them."""
    exact = f1 = 0.0
    all_questions = questions(dataset)
    for qa in all_questions:
        if qa["id"] not in predictions:
            print(f"Unanswered question {qa['id']} will receive score 0.", file=sys.stderr)
            continue
        golds = [answer["text"] for answer in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact += max(exact_match_score(prediction, g) for g in golds)
        f1 += max(_f1_v1(prediction, g) for g in golds)
    total = max(len(all_questions), 1)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def _f1_v1(prediction: str, gold: str) -> float:
    """v1.1's F1: no special case for empty answers (an empty one scores 0)."""
    predicted, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(predicted) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def raw_scores_v2(dataset: list, predictions: dict) -> tuple[dict, dict]:
    """Per-question exact and F1 (0/1 and [0, 1]) of the questions that have a prediction."""
    exact, f1 = {}, {}
    for qa in questions(dataset):
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        if qa["id"] not in predictions:
            print(f"Missing prediction for {qa['id']}", file=sys.stderr)
            continue
        prediction = predictions[qa["id"]]
        exact[qa["id"]] = max(exact_match_score(prediction, g) for g in golds)
        f1[qa["id"]] = max(f1_score(prediction, g) for g in golds)
    return exact, f1


def _with_threshold(scores: dict, na_probs: dict, has_answer: dict, threshold: float) -> dict:
    """A question predicted unanswerable (odds above `threshold`) scores 1 iff it is."""
    return {
        qid: float(not has_answer[qid]) if na_probs[qid] > threshold else score
        for qid, score in scores.items()
    }


def _summary(exact: dict, f1: dict, qids=None) -> dict:
    qids = list(exact) if qids is None else qids
    total = len(qids)
    return {
        "exact": 100.0 * sum(exact[q] for q in qids) / max(total, 1),
        "f1": 100.0 * sum(f1[q] for q in qids) / max(total, 1),
        "total": total,
    }


def _best_threshold(predictions, scores, na_probs, has_answer) -> tuple[float, float]:
    """The score (percent) and threshold when every question whose odds exceed the threshold
    is answered "" (starting from all answered "")."""
    score = best = sum(1 for qid in has_answer if not has_answer[qid])
    best_threshold = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            score += scores[qid]
        elif predictions[qid]:
            score -= 1
        if score > best:
            best, best_threshold = score, na_probs[qid]
    return 100.0 * best / max(len(scores), 1), best_threshold


def evaluate_v2(
    dataset: list, predictions: dict, na_probs: dict | None = None, na_prob_threshold=1.0
) -> dict:
    """The dictionary evaluate-v2.0.py prints, in its key order."""
    has_answer = {qa["id"]: bool(qa["answers"]) for qa in questions(dataset)}
    exact_raw, f1_raw = raw_scores_v2(dataset, predictions)
    odds = na_probs if na_probs is not None else dict.fromkeys(predictions, 0.0)
    missing = [qid for qid in exact_raw if qid not in odds]
    if missing:
        raise ValueError(
            f"the no-answer probabilities lack {len(missing)} predicted questions (first: "
            f"{missing[0]!r})"
        )
    exact = _with_threshold(exact_raw, odds, has_answer, na_prob_threshold)
    f1 = _with_threshold(f1_raw, odds, has_answer, na_prob_threshold)
    result = _summary(exact, f1)
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        qids = [qid for qid, has in has_answer.items() if has == wanted]
        if qids:
            missing = [qid for qid in qids if qid not in exact]
            if missing:
                raise ValueError(
                    f"no prediction for {len(missing)} questions (first: {missing[0]!r}): the "
                    "v2.0 HasAns/NoAns splits need every question predicted"
                )
            result.update({f"{name}_{k}": v for k, v in _summary(exact, f1, qids).items()})
    if na_probs is not None:
        best_exact, exact_threshold = _best_threshold(predictions, exact_raw, odds, has_answer)
        best_f1, f1_threshold = _best_threshold(predictions, f1_raw, odds, has_answer)
        result.update(
            best_exact=best_exact,
            best_exact_thresh=exact_threshold,
            best_f1=best_f1,
            best_f1_thresh=f1_threshold,
        )
    return result
