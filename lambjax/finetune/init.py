"""Where a fine-tuning run's encoder, vocabulary and lower-casing come from (`config.init`).

  workdir:PATH    a lambjax pretraining workdir: the parameters of the last phase (in its
                  phase_order) whose final checkpoint exists, and the run's vocabulary and
                  lower_case (a checkpoint that is unreadable, or whose arrays differ from
                  the digests its save recorded, is refused);
  hf:PATH         a transformers BERT directory (BertModel, BertForPreTraining, or a
                  fine-tuned one) with its vocab.txt, and do_lower_case from
                  tokenizer_config.json when it is there;
  tf:PATH         Google's original TensorFlow checkpoint directory (bert_config.json,
                  bert_model.ckpt.*, vocab.txt; lambjax.models.tf_checkpoint);
  scratch:PRESET  random weights of a preset (tests, baselines).

The pretrained pooler, where there is one, starts the classifier head's pooler.
"""

import dataclasses
import json
import os

from absl import logging
from etils import epath

from lambjax import storage
from lambjax.finetune.errors import FinetuneError
from lambjax.models.config import PRESETS, BertConfig


@dataclasses.dataclass
class Start:
    model_config: BertConfig
    params: dict | None  # embeddings, encoder and maybe heads/pooler (numpy); None: scratch
    vocab_file: str | None
    lower_case: bool | None  # as the checkpoint was trained, where it is known
    description: str
    vocab_source: str | None = None  # where vocab_file was copied from, if it was (gs://)


def load(init: str) -> Start:
    kind, _, value = init.partition(":")
    if kind == "workdir":
        return from_workdir(value)
    if kind == "hf":
        return from_hf(value)
    if kind == "tf":
        return from_tf(value)
    if kind == "scratch":
        if value not in PRESETS:
            raise FinetuneError(f"config.init={init!r}: unknown preset; valid: {list(PRESETS)}")
        return Start(BertConfig.preset(value), None, None, None, f"random {value} BERT")
    raise FinetuneError(
        f"config.init={init!r}; valid: workdir:PATH, hf:PATH, tf:PATH, scratch:PRESET"
    )


def _finished_phases(workdir: str) -> list[tuple[int, str, int, dict, object]]:
    """(rank in phase_order, phase, final step, meta, checkpoint path) of every phase whose
    final checkpoint exists."""
    from lambjax.train import checkpointing

    root = epath.Path(workdir) / "checkpoints"
    if not root.exists():
        raise FinetuneError(
            f"config.init=workdir:{workdir}: no checkpoints/ there; is it a "
            "lambjax pretraining workdir?"
        )
    finished = []
    for phase_dir, step, meta in checkpointing.saved_checkpoints(workdir):
        if "phase" not in meta:  # a fine-tuning run's checkpoints record their task instead
            raise FinetuneError(
                f"config.init=workdir:{workdir} is a fine-tuning run (task "
                f"{meta.get('task')!r}), not a pretraining one; to start from it, give "
                f"config.init=hf:{workdir}/transformers (its export)"
            )
        run_config = json.loads(meta["config"])
        order = run_config.get("phase_order", [])
        phase = meta["phase"]
        if phase in order and step == run_config["phases"][phase]["num_steps"]:
            finished.append((order.index(phase), phase, step, meta, phase_dir / str(step)))
    return sorted(finished, key=lambda f: f[0])


def from_workdir(workdir: str) -> Start:
    from lambjax.train import checkpointing

    workdir = storage.resolve(workdir)  # Orbax reads absolute paths only
    finished = _finished_phases(workdir)
    if not finished:
        raise FinetuneError(
            f"config.init=workdir:{workdir}: no phase of that run has finished "
            "(no final checkpoint); let pretraining finish a phase first"
        )
    _, phase, step, meta, path = finished[-1]
    try:
        state = checkpointing.read_verified_state(path, meta)
    except Exception as error:  # noqa: BLE001 - Orbax, tensorstore and the digests raise alike
        raise FinetuneError(
            f"config.init=workdir:{workdir}: checkpoint {path} cannot be used "
            f"({type(error).__name__}: {storage.reason(error)}); rerun the pretraining command "
            "on that workdir: it sets the checkpoint aside and trains again from the one before"
        ) from error
    config = BertConfig.from_dict(meta["model_config"])
    run_config = json.loads(meta["config"])
    vocab = meta.get("vocab_file")
    vocab = vocab if vocab and epath.Path(vocab).exists() else None
    return Start(
        config,
        state["params"],
        storage.local_copy(vocab) if vocab else None,
        run_config.get("data", {}).get("lower_case"),
        f"phase {phase} (step {step}) of {workdir}",
        vocab,
    )


def from_hf(path: str) -> Start:
    from lambjax.models import hf

    if not epath.Path(path, "config.json").is_file():
        raise FinetuneError(
            f"config.init=hf:{path}: no config.json there; not a transformers checkpoint directory"
        )
    path = storage.local_copy(path)  # transformers' files are read from local disk
    try:
        config, params = hf.from_transformers(path)
    except json.JSONDecodeError as e:
        raise FinetuneError(f"config.init=hf:{path}: config.json is not valid JSON ({e})") from e
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise FinetuneError(f"config.init=hf:{path}: {e}") from e
    lower_case = None
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config, encoding="utf-8") as f:
            lower_case = json.load(f).get("do_lower_case")
    vocab = os.path.join(path, "vocab.txt")
    return Start(
        config,
        params,
        vocab if os.path.isfile(vocab) else None,
        lower_case,
        f"transformers checkpoint {path}",
    )


def from_tf(path: str) -> Start:
    from lambjax.models import tf_checkpoint

    if not epath.Path(path, tf_checkpoint.CONFIG_FILE).is_file():
        raise FinetuneError(
            f"config.init=tf:{path}: no {tf_checkpoint.CONFIG_FILE} there; not a TensorFlow "
            "BERT checkpoint directory"
        )
    path = storage.local_copy(path)
    try:
        config, params, _ = tf_checkpoint.from_tf_checkpoint(path)
    except (OSError, ValueError) as e:
        raise FinetuneError(f"config.init=tf:{path}: {e}") from e
    vocab = os.path.join(path, "vocab.txt")
    vocab = vocab if os.path.isfile(vocab) else None
    lower_case = None if vocab is None else not vocabulary_is_cased(vocab)
    return Start(config, params, vocab, lower_case, f"TensorFlow checkpoint {path}")


def vocabulary_is_cased(vocab_file: str) -> bool:
    """A vocabulary is cased if any of its ordinary tokens has an upper-case letter."""
    from lambjax.data import tokenization

    for token in tokenization.read_vocab(vocab_file):  # DataError unless UTF-8 text
        token = token.strip()
        if not (token.startswith("[") and token.endswith("]")) and token != token.lower():
            return True
    return False


def resolve_lower_case(requested: bool | None, start: Start, vocab_file: str) -> bool:
    """config.lower_case, else the checkpoint's, else the vocabulary's; mismatches warned."""
    cased_vocab = vocabulary_is_cased(vocab_file)
    lower_case = requested
    if lower_case is None:
        lower_case = start.lower_case if start.lower_case is not None else not cased_vocab
    problems = []
    if start.lower_case is not None and lower_case != start.lower_case:
        problems.append(f"the checkpoint was trained with lower_case={start.lower_case}")
    if lower_case == cased_vocab:
        problems.append(
            f"the vocabulary {vocab_file} is {'cased' if cased_vocab else 'uncased'} (it has "
            f"{'' if cased_vocab else 'no '}upper-case tokens)"
        )
    if problems:
        logging.warning(
            "lower_case=%s but %s: the text is tokenized unlike in pretraining (the common "
            "cause of near-zero SQuAD F1); set --config.lower_case to match",
            lower_case,
            " and ".join(problems),
        )
    return lower_case
