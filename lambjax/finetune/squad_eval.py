r"""Scores SQuAD predictions, with the official evaluation scripts' interface and output.

  python -m lambjax.finetune.squad_eval DATA.json PREDICTIONS.json [--na-prob-file F]

DATA.json is a SQuAD file as published (`{"version": ..., "data": [...]}`), PREDICTIONS.json
`{question_id: answer_text}` (what `lambjax.finetune` writes as predictions.json). A v1.1
file prints `{"exact_match": ..., "f1": ...}` like evaluate-v1.1.py; a v2.0 file (or any file
given --na-prob-file, e.g. the null_odds.json of a v2.0 run) prints evaluate-v2.0.py's
dictionary: exact, f1, total, the HasAns/NoAns splits and, with the odds, the best
thresholds. Bad input ends with one line on stderr and exit status 2.
"""

import argparse
import json
import sys

from lambjax.finetune import squad_metrics


class InputError(ValueError):
    """A file the scorer cannot use; the message is one line for the user."""


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise InputError(f"{what} {path!r}: no such file") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{what} {path!r} is not valid JSON: {e}") from e


def load_dataset(path: str) -> tuple[list, str]:
    """(the `data` list, the version string) of a SQuAD file, its structure checked."""
    dataset = _read_json(path, "SQuAD data file")
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise InputError(f"SQuAD data file {path!r} has no 'data' list: not SQuAD's format")
    try:
        for qa in squad_metrics.questions(dataset["data"]):
            if not isinstance(qa["id"], str) or not isinstance(qa["answers"], list):
                raise TypeError(qa.get("id"))
            for answer in qa["answers"]:
                if not isinstance(answer["text"], str):
                    raise TypeError(qa["id"])
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(
            f"SQuAD data file {path!r}: an article, paragraph or question lacks a SQuAD field "
            f"({type(e).__name__}: {e})"
        ) from e
    return dataset["data"], str(dataset.get("version", ""))


def load_predictions(path: str, what: str = "predictions file") -> dict:
    predictions = _read_json(path, what)
    if not isinstance(predictions, dict):
        raise InputError(f"{what} {path!r} must hold one JSON object {{question_id: value}}")
    return predictions


def is_v2(version: str) -> bool:
    return version.lstrip("v").startswith("2")


def evaluate_files(data_file: str, predictions_file: str, na_prob_file=None, threshold=1.0):
    """The official scripts' result dictionary for these files."""
    dataset, version = load_dataset(data_file)
    predictions = load_predictions(predictions_file)
    bad = [qid for qid, text in predictions.items() if not isinstance(text, str)]
    if bad:
        raise InputError(
            f"predictions file {predictions_file!r}: the answer to {bad[0]!r} is not a string"
        )
    if na_prob_file is None and not is_v2(version):
        return squad_metrics.evaluate_v1(dataset, predictions)
    na_probs = (
        load_predictions(na_prob_file, "no-answer probability file") if na_prob_file else None
    )
    try:
        return squad_metrics.evaluate_v2(dataset, predictions, na_probs, threshold)
    except ValueError as e:
        raise InputError(str(e)) from e


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lambjax.finetune.squad_eval",
        description="Scores SQuAD v1.1 / v2.0 predictions as the official scripts do.",
    )
    parser.add_argument("data_file", metavar="DATA.json")
    parser.add_argument("pred_file", metavar="PREDICTIONS.json")
    parser.add_argument("--na-prob-file", "-n", help="no-answer odds per question (v2.0)")
    parser.add_argument(
        "--na-prob-thresh",
        "-t",
        type=float,
        default=1.0,
        help="predict no-answer when the odds exceed this (default 1.0)",
    )
    parser.add_argument("--out-file", "-o", help="also write the result JSON here")
    args = parser.parse_args(argv)
    try:
        result = evaluate_files(
            args.data_file, args.pred_file, args.na_prob_file, args.na_prob_thresh
        )
    except InputError as error:
        print(f"lambjax.finetune.squad_eval: error: {error}", file=sys.stderr)
        return 2
    v1 = set(result) == {"exact_match", "f1"}
    text = json.dumps(result) if v1 else json.dumps(result, indent=2)
    if args.out_file:
        with open(args.out_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
