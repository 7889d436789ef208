"""Pretraining that starts from a published model (`config.init`): domain-adaptive pretraining.

  hf:DIR        a transformers BERT directory (BertModel or BertForPreTraining) with its
                vocab.txt (and tokenizer_config.json, whose do_lower_case is the casing);
  tf:DIR        Google's original TensorFlow checkpoint directory (bert_config.json,
                bert_model.ckpt.*, vocab.txt; lambjax.models.tf_checkpoint);
  workdir:PATH  another lambjax pretraining run: its last finished phase.

The run's first phase starts from the checkpoint's weights, with a fresh optimizer state; its
MLM and NSP heads are the checkpoint's where it has them, else initialised (the run says
which). The checkpoint fixes the vocabulary, the casing and the model's shape: `data.vocab`
"train" means the checkpoint's vocab.txt, and a config that contradicts any of them stops
(`ConfigError`) before anything is written. The run records `init` in its config
(WORKDIR/config.json and every checkpoint); once it has a checkpoint, it resumes, exports
and fine-tunes as any other run.
"""

import dataclasses
import json
import os

import jax
import numpy as np
from absl import logging
from etils import epath

from lambjax import storage
from lambjax.models.config import PRESETS, SIZE_FIELDS, BertConfig
from lambjax.train.config import ConfigError

KINDS = ("hf", "tf", "workdir")
# The fields of the model that its weights fix (the others, e.g. dtype or dropout, are the
# run's choice).
SHAPE_FIELDS = (*SIZE_FIELDS, "layer_norm", "normalization", "gelu_approximate")


@dataclasses.dataclass(frozen=True)
class Published:
    """A published model, read onto the host."""

    init: str  # as the config gives it, e.g. "hf:/models/bert-base-uncased"
    model_config: BertConfig
    params: dict  # numpy arrays, the pretraining model's tree
    vocab_file: str | None
    lower_case: bool | None  # None: not recorded by the checkpoint
    heads: str  # which pretraining heads came from the checkpoint, in words
    description: str


def load(init: str) -> Published:
    """Reads `config.init`; ConfigError naming it and what is wrong."""
    kind, _, path = init.partition(":")
    if kind not in KINDS or not path:
        raise ConfigError(f"config.init={init!r}; valid: '' (random), hf:DIR, tf:DIR, workdir:PATH")
    if not epath.Path(path).is_dir():
        raise ConfigError(f"config.init={init!r}: {path} is not a directory")
    try:
        if kind == "workdir":
            return _from_workdir(init, path)
        return _from_checkpoint(init, kind, path)
    except (OSError, ValueError, KeyError) as error:
        message = str(error).strip().splitlines()[0]
        if isinstance(error, ConfigError) or message.startswith("config.init="):
            raise ConfigError(message) from None
        raise ConfigError(f"config.init={init!r}: {message}") from None


def _from_workdir(init: str, path: str) -> Published:
    from lambjax.finetune import init as finetune_init

    start = finetune_init.from_workdir(path)
    return Published(
        init,
        start.model_config,
        start.params,
        start.vocab_source or start.vocab_file,  # as recorded: a resume sees the same config
        start.lower_case,
        "MLM and NSP heads from the run",
        start.description,
    )


def _from_checkpoint(init: str, kind: str, path: str) -> Published:
    from lambjax.models import hf, tf_checkpoint

    marker = "config.json" if kind == "hf" else tf_checkpoint.CONFIG_FILE
    if not epath.Path(path, marker).is_file():
        other = "tf" if kind == "hf" else "hf"
        other_marker = tf_checkpoint.CONFIG_FILE if kind == "hf" else "config.json"
        hint = (
            f"; it looks like {other}:{path}"
            if epath.Path(path, other_marker).is_file()
            else "; neither a transformers (config.json) nor a TensorFlow BERT "
            "(bert_config.json) checkpoint directory"
        )
        raise ConfigError(f"config.init={init!r}: no {marker} in {path}{hint}")
    local = storage.local_copy(path)  # both readers take local files
    if kind == "hf":
        with open(os.path.join(local, "config.json"), encoding="utf-8") as f:
            config = hf.config_from_hf(json.load(f))
        state = hf.load_state_dict(local)
        params, missing = hf.params_from_state(config, state, path)
        description = f"transformers checkpoint {path}"
    else:
        config, params, missing = tf_checkpoint.from_tf_checkpoint(local)
        description = f"TensorFlow checkpoint {path}"
    encoder_missing = [n for n in missing if not n.startswith(("cls.", "bert.pooler", "pooler"))]
    if encoder_missing:  # only the heads (and the pooler) may be initialised
        raise ValueError(f"the checkpoint lacks encoder weights, e.g. {encoder_missing[0]}")
    vocab = epath.Path(path) / "vocab.txt"  # as given: the run's config records it
    return Published(
        init,
        config,
        params,
        os.fspath(vocab) if vocab.is_file() else None,
        _lower_case(local),
        _heads_found(missing),
        description,
    )


def _lower_case(directory: str) -> bool | None:
    """The casing a transformers tokenizer_config.json records, else that of vocab.txt
    (Google's checkpoints record it only in their names: uncased_L-12_H-768_A-12)."""
    from lambjax.finetune import init as finetune_init

    tokenizer_config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config, encoding="utf-8") as f:
            lower_case = json.load(f).get("do_lower_case")
        if lower_case is not None:
            return bool(lower_case)
    vocab = os.path.join(directory, "vocab.txt")
    if os.path.isfile(vocab):
        return not finetune_init.vocabulary_is_cased(vocab)
    return None


def _heads_found(missing: list[str]) -> str:
    def has(prefix):
        return not any(name.startswith(prefix) for name in missing)

    heads = {"MLM": has("cls.predictions"), "NSP": has("cls.seq_relationship")}
    taken = [name for name, found in heads.items() if found]
    fresh = [name for name, found in heads.items() if not found]
    parts = []
    if taken:
        parts.append(f"{' and '.join(taken)} head{'s' if len(taken) > 1 else ''} from it")
    if fresh:
        parts.append(f"{' and '.join(fresh)} head{'s' if len(fresh) > 1 else ''} initialised")
    return ", ".join(parts)


def adopt_vocabulary(published: Published, data_config) -> None:
    """Makes `data_config` use the checkpoint's vocabulary and casing; ConfigError if it
    names others. `data.vocab="train"` (the default) means the checkpoint's vocab.txt."""
    init = published.init
    if data_config.vocab == "train":
        if published.vocab_file is None:
            raise ConfigError(
                f"config.init={init!r} has no vocab.txt; give its vocabulary as "
                f"--config.data.vocab=FILE"
            )
        data_config.vocab = published.vocab_file
    elif published.vocab_file is not None:
        given = epath.Path(data_config.vocab)
        if (
            not given.is_file()
            or given.read_bytes() != epath.Path(published.vocab_file).read_bytes()
        ):
            raise ConfigError(
                f"config.data.vocab={data_config.vocab!r} is not the vocabulary of "
                f"config.init={init!r} ({published.vocab_file}); leave data.vocab='train' "
                f"to use the checkpoint's"
            )
    num_tokens = len(epath.Path(data_config.vocab).read_text(encoding="utf-8").splitlines())
    if num_tokens > published.model_config.vocab_size:
        raise ConfigError(
            f"config.data.vocab={data_config.vocab!r} has {num_tokens} tokens, more than the "
            f"{published.model_config.vocab_size} embeddings of config.init={init!r}"
        )
    lower_case = published.lower_case
    if lower_case is not None and data_config.lower_case != lower_case:
        raise ConfigError(
            f"config.data.lower_case={data_config.lower_case} contradicts config.init={init!r}, "
            f"which was trained with lower_case={lower_case}; give "
            f"--config.data.lower_case={str(lower_case).lower()}"
        )


def check_model(published: Published, model: BertConfig) -> None:
    """ConfigError unless the config's model (the first phase's) has the checkpoint's shape."""
    ours, theirs = dataclasses.asdict(model), dataclasses.asdict(published.model_config)
    differing = [field for field in SHAPE_FIELDS if ours[field] != theirs[field]]
    if not differing:
        return
    shown = ", ".join(f"{f}={ours[f]} (the checkpoint: {theirs[f]})" for f in differing)
    preset = next(
        (
            name
            for name, sizes in PRESETS.items()
            if all(theirs[field] == value for field, value in sizes.items())
        ),
        None,
    )
    fix = f"--config.model.preset={preset}" if preset else "--config.model.overrides.FIELD=VALUE"
    raise ConfigError(
        f"config.model contradicts config.init={published.init!r}: {shown}; give {fix} "
        f"(and drop phase num_layers overrides) to match it"
    )


def initial_params(published: Published, abstract_params) -> dict:
    """The checkpoint's parameters in the tree, shapes and dtypes of the phase's state;
    ConfigError where the trees differ (a model option the checkpoint does not have)."""
    structure = jax.tree.structure(abstract_params)
    if jax.tree.structure(published.params) != structure:
        raise ConfigError(
            f"config.init={published.init!r}: the config's model has other parameters than the "
            f"checkpoint's (a model option it was not trained with?)"
        )

    def cast(value, target):
        value = np.asarray(value)
        if value.shape != target.shape:
            raise ConfigError(
                f"config.init={published.init!r}: a parameter of shape {value.shape} where "
                f"the config's model has {target.shape}"
            )
        return value.astype(target.dtype)

    return jax.tree.map(cast, published.params, abstract_params)


def log_start(published: Published, phase_name: str) -> None:
    logging.info(
        "Phase %s: starting from %s (%s; %s)",
        phase_name,
        published.description,
        published.init,
        published.heads,
    )
