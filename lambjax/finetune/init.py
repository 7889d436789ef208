"""Where a fine-tuning run's encoder, vocabulary and lower-casing come from (`config.init`).

  workdir:PATH    a lambjax pretraining workdir: the last phase that finished;
  hf:PATH         a transformers BERT directory (BertModel, BertForPreTraining, or a
                  fine-tuned one) with its vocab.txt;
  tf:PATH         Google's original TensorFlow checkpoint directory;
  scratch:PRESET  random weights of a preset (tests, baselines).

The first three are read as pretraining reads them (lambjax.train.published: the same
parameters, vocabulary and casing, and the same checks); their errors reach the user as
FinetuneError. The pretrained pooler, where there is one, starts the classifier head's
pooler.
"""

import dataclasses

from absl import logging

from lambjax.data import tokenization
from lambjax.finetune.errors import FinetuneError
from lambjax.models.config import PRESETS, BertConfig
from lambjax.train import published
from lambjax.train.config import ConfigError


@dataclasses.dataclass
class Start:
    model_config: BertConfig
    params: dict | None  # embeddings, encoder and maybe heads/pooler (numpy); None: scratch
    vocab_file: str | None  # on local disk
    lower_case: bool | None  # as the checkpoint was trained, where it is known
    description: str


def load(init: str) -> Start:
    """The start `config.init` names; FinetuneError naming it and what is wrong."""
    kind, _, value = init.partition(":")
    if kind == "scratch":
        if value not in PRESETS:
            raise FinetuneError(f"config.init={init!r}: unknown preset; valid: {list(PRESETS)}")
        return Start(BertConfig.preset(value), None, None, None, f"random {value} BERT")
    if kind not in published.KINDS or not value:
        raise FinetuneError(
            f"config.init={init!r}; valid: workdir:PATH, hf:PATH, tf:PATH, scratch:PRESET"
        )
    try:
        checkpoint = published.load(init)
    except ConfigError as error:
        raise FinetuneError(str(error)) from None
    return from_published(checkpoint)


def from_published(checkpoint: published.Published) -> Start:
    """Fine-tuning's start from a published model: its encoder (and pooler), its vocabulary
    on local disk, its casing."""
    from lambjax.models import hf

    hf.warn_initialised(checkpoint.description, checkpoint.initialised)
    return Start(
        checkpoint.model_config,
        checkpoint.params,
        checkpoint.local_vocab_file,
        checkpoint.lower_case,
        checkpoint.description,
    )


def resolve_lower_case(requested: bool | None, start: Start, vocab_file: str) -> bool:
    """config.lower_case, else the checkpoint's, else the vocabulary's; mismatches warned."""
    cased_vocab = tokenization.vocabulary_is_cased(vocab_file)
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
