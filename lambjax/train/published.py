"""A published model named by `config.init`, read for pretraining and fine-tuning alike.

  hf:DIR        a transformers BERT directory (BertModel, BertForPreTraining, or a fine-tuned
                BERT, whose task head is not read; model.safetensors or pytorch_model.bin)
                with its vocab.txt (and tokenizer_config.json, whose do_lower_case is the
                casing; else that of vocab.txt);
  tf:DIR        Google's original TensorFlow checkpoint directory (bert_config.json,
                bert_model.ckpt.*, vocab.txt; lambjax.models.tf_checkpoint);
  workdir:PATH  another lambjax pretraining run: the parameters of the last phase (in its
                phase_order) whose final checkpoint exists, and the run's vocabulary and
                lower_case (a checkpoint that is unreadable, or whose arrays differ from the
                digests its save recorded, is refused).

`load` reads any of them into a `Published` (ConfigError naming the value and what is
wrong); lambjax.finetune.init starts fine-tuning from one (and adds its scratch:PRESET).

Pretraining from one (domain-adaptive pretraining): the run's first phase starts from the
checkpoint's weights, with a fresh optimizer state; its MLM and NSP heads are the
checkpoint's where it has them, else initialised (the run says which). The checkpoint fixes
the vocabulary, the casing and the model's shape: `data.vocab` "train" means the
checkpoint's vocab.txt, and a config that contradicts any of them stops (`ConfigError`)
before anything is written. The run records `init` in its config (WORKDIR/config.json and
every checkpoint); once it has a checkpoint, it resumes, exports and fine-tunes as any
other run.
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
    params: dict  # numpy arrays, the pretraining model's tree (missing heads initialised)
    vocab_file: str | None  # as given or recorded (gs:// stays gs://): what a run records
    lower_case: bool | None  # None: neither recorded by the checkpoint nor its vocab.txt's
    heads: str  # which pretraining heads came from the checkpoint, in words
    description: str
    local_vocab_file: str | None = None  # vocab_file on local disk (a copy of a remote one)
    initialised: tuple[str, ...] = ()  # the weights it lacks (transformers' names)


def load(init: str) -> Published:
    """Reads `config.init`; ConfigError naming it and what is wrong."""
    kind, _, path = init.partition(":")
    if kind not in KINDS or not path:
        raise ConfigError(f"config.init={init!r}; valid: '' (random), hf:DIR, tf:DIR, workdir:PATH")
    if not epath.Path(path).is_dir():
        raise ConfigError(f"config.init={init!r}: {path} is not a directory")
    read = {"hf": _from_hf, "tf": _from_tf, "workdir": _from_workdir}[kind]
    try:
        return read(init, path)
    except (OSError, ValueError, KeyError) as error:
        message = str(error).strip().splitlines()[0]
        if isinstance(error, ConfigError) or message.startswith("config.init="):
            raise ConfigError(message) from None
        raise ConfigError(f"config.init={init!r}: {message}") from None


def _from_workdir(init: str, path: str) -> Published:
    from lambjax.train import checkpointing

    workdir = storage.resolve(path)  # Orbax reads absolute paths only
    finished = _finished_phases(workdir)
    if not finished:
        raise ConfigError(
            f"config.init=workdir:{workdir}: no phase of that run has finished "
            "(no final checkpoint); let pretraining finish a phase first"
        )
    _, phase, step, meta, checkpoint = finished[-1]
    try:
        state = checkpointing.read_verified_state(checkpoint, meta)
    except Exception as error:  # noqa: BLE001 - Orbax, tensorstore and the digests raise alike
        raise ConfigError(
            f"config.init=workdir:{workdir}: checkpoint {checkpoint} cannot be used "
            f"({type(error).__name__}: {storage.reason(error)}); rerun the pretraining command "
            "on that workdir: it sets the checkpoint aside and trains again from the one before"
        ) from error
    run_config = json.loads(meta["config"])
    vocab = meta.get("vocab_file")
    vocab = vocab if vocab and epath.Path(vocab).exists() else None
    return Published(
        init,
        BertConfig.from_dict(meta["model_config"]),
        state["params"],
        vocab,  # as recorded: a resume sees the same config
        run_config.get("data", {}).get("lower_case"),
        "MLM and NSP heads from the run",
        f"phase {phase} (step {step}) of {workdir}",
        local_vocab_file=storage.local_copy(vocab) if vocab else None,
    )


def _finished_phases(workdir: str) -> list[tuple[int, str, int, dict, object]]:
    """(rank in phase_order, phase, final step, meta, checkpoint path) of every phase whose
    final checkpoint exists."""
    from lambjax.train import checkpointing

    root = epath.Path(workdir) / "checkpoints"
    if not root.exists():
        raise ConfigError(
            f"config.init=workdir:{workdir}: no checkpoints/ there; is it a "
            "lambjax pretraining workdir?"
        )
    finished = []
    for phase_dir, step, meta in checkpointing.saved_checkpoints(workdir):
        if "phase" not in meta:  # a fine-tuning run's checkpoints record their task instead
            raise ConfigError(
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


def _from_hf(init: str, path: str) -> Published:
    from lambjax.models import hf

    _check_directory(init, "hf", path)
    local = storage.local_copy(path)  # safetensors and torch read local files
    try:
        config, params, missing = hf.read_transformers(local, where=path)
    except json.JSONDecodeError as error:
        raise ValueError(f"config.json is not valid JSON ({error})") from None
    return _from_files(init, path, local, config, params, missing, "transformers")


def _from_tf(init: str, path: str) -> Published:
    from lambjax.models import tf_checkpoint

    _check_directory(init, "tf", path)
    local = storage.local_copy(path)  # TensorFlow's reader takes local files
    config, params, missing = tf_checkpoint.from_tf_checkpoint(local)
    return _from_files(init, path, local, config, params, missing, "TensorFlow")


def _check_directory(init: str, kind: str, path: str) -> None:
    """ConfigError unless `path` holds the config file of a `kind` checkpoint; it names the
    other kind where the directory is one."""
    from lambjax.models import tf_checkpoint

    marker = "config.json" if kind == "hf" else tf_checkpoint.CONFIG_FILE
    if epath.Path(path, marker).is_file():
        return
    other = "tf" if kind == "hf" else "hf"
    other_marker = tf_checkpoint.CONFIG_FILE if kind == "hf" else "config.json"
    hint = (
        f"; it looks like {other}:{path}"
        if epath.Path(path, other_marker).is_file()
        else "; neither a transformers (config.json) nor a TensorFlow BERT "
        "(bert_config.json) checkpoint directory"
    )
    raise ConfigError(f"config.init={init!r}: no {marker} in {path}{hint}")


def _from_files(
    init: str,
    path: str,
    local: str,
    config: BertConfig,
    params: dict,
    missing: list[str],
    library: str,
) -> Published:
    """The Published of an hf: or tf: directory `path` (read from its copy `local`)."""
    encoder_missing = [n for n in missing if not n.startswith(("cls.", "bert.pooler", "pooler"))]
    if encoder_missing:  # only the heads (and the pooler) may be initialised
        raise ValueError(f"the checkpoint lacks encoder weights, e.g. {encoder_missing[0]}")
    vocab = epath.Path(path) / "vocab.txt"  # as given: the run's config records it
    has_vocab = vocab.is_file()
    return Published(
        init,
        config,
        params,
        os.fspath(vocab) if has_vocab else None,
        _lower_case(local),
        _heads_found(missing),
        f"{library} checkpoint {path}",
        local_vocab_file=os.path.join(local, "vocab.txt") if has_vocab else None,
        initialised=tuple(missing),
    )


def _lower_case(directory: str) -> bool | None:
    """The casing a transformers tokenizer_config.json records, else that of vocab.txt
    (Google's checkpoints record it only in their names: uncased_L-12_H-768_A-12)."""
    from lambjax.data import tokenization

    tokenizer_config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config, encoding="utf-8") as f:
            lower_case = json.load(f).get("do_lower_case")
        if lower_case is not None:
            return bool(lower_case)
    vocab = os.path.join(directory, "vocab.txt")
    if os.path.isfile(vocab):
        return not tokenization.vocabulary_is_cased(vocab)
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


def vocabulary(published: Published, data_config) -> str:
    """The vocabulary file a run from `published` uses: its vocab.txt where `data.vocab` is
    "train" (the default), else the one given, which must be the same file; ConfigError if
    the config names another vocabulary or casing than the checkpoint's."""
    init = published.init
    vocab = data_config.vocab
    if vocab == "train":
        if published.vocab_file is None:
            raise ConfigError(
                f"config.init={init!r} has no vocab.txt; give its vocabulary as "
                f"--config.data.vocab=FILE"
            )
        vocab = published.vocab_file
    elif published.vocab_file is not None:
        given = epath.Path(vocab)
        if (
            not given.is_file()
            or given.read_bytes() != epath.Path(published.vocab_file).read_bytes()
        ):
            raise ConfigError(
                f"config.data.vocab={vocab!r} is not the vocabulary of "
                f"config.init={init!r} ({published.vocab_file}); leave data.vocab='train' "
                f"to use the checkpoint's"
            )
    num_tokens = len(epath.Path(vocab).read_text(encoding="utf-8").splitlines())
    if num_tokens > published.model_config.vocab_size:
        raise ConfigError(
            f"config.data.vocab={vocab!r} has {num_tokens} tokens, more than the "
            f"{published.model_config.vocab_size} embeddings of config.init={init!r}"
        )
    lower_case = published.lower_case
    if lower_case is not None and data_config.lower_case != lower_case:
        raise ConfigError(
            f"config.data.lower_case={data_config.lower_case} contradicts config.init={init!r}, "
            f"which was trained with lower_case={lower_case}; give "
            f"--config.data.lower_case={str(lower_case).lower()}"
        )
    return vocab


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
