"""Weights to and from Hugging Face `transformers` BERT (PyTorch) checkpoint directories.

  config, params = from_transformers("path/to/bert")        # BertModel or BertForPreTraining
  to_transformers(config, params, "out", vocab_file=...)     # BertForPreTraining.from_pretrained

Reads model.safetensors (or pytorch_model.bin, which needs torch). A BertModel checkpoint has
no pretraining heads: they are initialised and reported. Only PostLN BERT exists in
transformers, so PreLN models do not export.

A training run's latest checkpoint exports from the command line with lambjax.export.
"""

import json
import os
import shutil

import jax
import numpy as np
from absl import logging

from lambjax.models.config import BertConfig
from lambjax.models.params import init_params

_EMBEDDINGS = {
    ("embeddings", "word", "embedding"): "embeddings.word_embeddings.weight",
    ("embeddings", "position", "embedding"): "embeddings.position_embeddings.weight",
    ("embeddings", "token_type", "embedding"): "embeddings.token_type_embeddings.weight",
    ("embeddings", "layer_norm", "scale"): "embeddings.LayerNorm.weight",
    ("embeddings", "layer_norm", "bias"): "embeddings.LayerNorm.bias",
}
# Per layer: our path under encoder/layers -> (HF name under encoder.layer.{i}, kind).
_LAYER = {
    ("attention", "query"): ("attention.self.query", "heads_out"),
    ("attention", "key"): ("attention.self.key", "heads_out"),
    ("attention", "value"): ("attention.self.value", "heads_out"),
    ("attention", "output"): ("attention.output.dense", "heads_in"),
    ("attention_layer_norm",): ("attention.output.LayerNorm", "norm"),
    ("mlp", "intermediate"): ("intermediate.dense", "dense"),
    ("mlp", "output"): ("output.dense", "dense"),
    ("mlp_layer_norm",): ("output.LayerNorm", "norm"),
}
_HEADS = {
    ("pooler",): ("bert.pooler.dense", "dense"),
    ("nsp",): ("cls.seq_relationship", "dense"),
    ("mlm_transform",): ("cls.predictions.transform.dense", "dense"),
    ("mlm_layer_norm",): ("cls.predictions.transform.LayerNorm", "norm"),
}


# transformers' names of the two GELUs lambjax has (BertConfig.gelu_approximate).
_HIDDEN_ACT = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def config_from_hf(hf: dict) -> BertConfig:
    hidden_act = hf.get("hidden_act", "gelu")
    if hidden_act not in _HIDDEN_ACT:
        raise ValueError(
            f"hidden_act={hidden_act!r}: lambjax BERT runs {sorted(_HIDDEN_ACT)} "
            "(exact GELU, or its tanh approximation)"
        )
    return BertConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        initializer_range=hf.get("initializer_range", 0.02),
        gelu_approximate=_HIDDEN_ACT[hidden_act],
        dtype="float32",
    )


def config_to_hf(config: BertConfig) -> dict:
    return {
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "gelu_pytorch_tanh" if config.gelu_approximate else "gelu",
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "layer_norm_eps": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    safetensors_file = os.path.join(path, "model.safetensors")
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(safetensors_file):
        from safetensors.numpy import load_file

        return load_file(safetensors_file)
    if os.path.exists(bin_file):
        import torch

        state = torch.load(bin_file, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"{path}: neither model.safetensors nor pytorch_model.bin")


def _to_ours(weight: np.ndarray, kind: str, config: BertConfig, is_bias: bool):
    heads, head_dim = config.num_heads, config.head_dim
    if kind == "norm" or (is_bias and kind in ("dense", "heads_in")):
        return weight
    if kind == "heads_out":  # [E_out, E_in] -> [E_in, heads, head_dim]; bias -> [heads, d]
        return weight.reshape(heads, head_dim) if is_bias else weight.T.reshape(-1, heads, head_dim)
    if kind == "heads_in":  # [E_out, E_in] -> [heads, head_dim, E_out]
        return weight.T.reshape(heads, head_dim, -1)
    return weight.T  # dense: torch [out, in] -> flax [in, out]


def _to_hf(weight: np.ndarray, kind: str, is_bias: bool):
    if kind == "norm" or (is_bias and kind in ("dense", "heads_in")):
        return weight
    if kind == "heads_out":
        return weight.reshape(-1) if is_bias else weight.reshape(weight.shape[0], -1).T
    if kind == "heads_in":
        return weight.reshape(-1, weight.shape[-1]).T
    return weight.T


def _leaf_names(kind):
    return (
        (("scale", "weight"), ("bias", "bias"))
        if kind == "norm"
        else (
            ("kernel", "weight"),
            ("bias", "bias"),
        )
    )


def from_transformers(path: str) -> tuple[BertConfig, dict]:
    """Imports a transformers BERT checkpoint directory; returns (config, params)."""
    config, params, missing = read_transformers(path)
    warn_initialised(path, missing)
    return config, params


def read_transformers(path: str, where: str | None = None) -> tuple[BertConfig, dict, list[str]]:
    """(config, params, names of the weights it lacks, which were initialised) of the local
    transformers BERT directory `path` (BertModel, BertForPreTraining, or a fine-tuned BERT:
    its task head is not read); errors name `where` (default: `path`)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = config_from_hf(json.load(f))
    params, missing = params_from_state(config, load_state_dict(path), where or path)
    return config, params, missing


def warn_initialised(where: str, missing: list[str] | tuple[str, ...]) -> None:
    """Logs which weights a checkpoint lacked (and were initialised), if any."""
    if missing:
        logging.warning(
            "%s: %d weights not in the checkpoint were initialised: %s",
            where,
            len(missing),
            ", ".join(sorted({m.split(".")[0] for m in missing})),
        )


def params_from_state(
    config: BertConfig, state: dict[str, np.ndarray], where: str
) -> tuple[dict, list[str]]:
    """(params, names of the weights `state` lacks, which were initialised) of a BERT whose
    weights are `state`, under transformers' names and shapes (`bert.`-prefixed or not).
    A weight whose shape is not the one `config` gives raises ValueError naming it."""
    prefix = "bert." if any(k.startswith("bert.") for k in state) else ""
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    expected = {
        name.replace("bert.", prefix, 1): value.shape
        for name, value in _pretraining_state(config, params).items()
    }
    for name, value in state.items():
        if name in expected and tuple(value.shape) != tuple(expected[name]):
            raise ValueError(
                f"{where}: {name} has shape {tuple(value.shape)}, but its config "
                f"(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, ...) "
                f"gives {tuple(expected[name])}"
            )
    missing = []

    def take(name):
        if name not in state:
            missing.append(name)
            return None
        return np.asarray(state[name]).astype(np.float32)

    for ours, theirs in _EMBEDDINGS.items():
        value = take(prefix + theirs)
        if value is not None:
            params[ours[0]][ours[1]][ours[2]] = value
    layers = params["encoder"]["layers"]
    for ours, (theirs, kind) in _LAYER.items():
        node = layers
        for key in ours:
            node = node[key]
        for leaf, hf_leaf in _leaf_names(kind):
            slices = [
                take(f"{prefix}encoder.layer.{i}.{theirs}.{hf_leaf}")
                for i in range(config.num_layers)
            ]
            if all(s is not None for s in slices):
                node[leaf] = np.stack(
                    [_to_ours(s, kind, config, leaf == "bias") for s in slices]
                ).astype(np.float32)
    heads = params["heads"]
    for (ours,), (theirs, kind) in _HEADS.items():
        name = theirs if theirs.startswith("cls.") else theirs.replace("bert.", prefix, 1)
        for leaf, hf_leaf in _leaf_names(kind):
            value = take(f"{name}.{hf_leaf}")
            if value is not None:
                heads[ours][leaf] = _to_ours(value, kind, config, leaf == "bias")
    bias = take("cls.predictions.bias")
    if bias is not None:
        heads["mlm_bias"] = bias
    return params, missing


def _encoder_state(config: BertConfig, params: dict) -> dict[str, np.ndarray]:
    """The embeddings' and encoder layers' tensors under transformers' `bert.` names."""
    state = {}
    for ours, theirs in _EMBEDDINGS.items():
        state["bert." + theirs] = params[ours[0]][ours[1]][ours[2]]
    for ours, (theirs, kind) in _LAYER.items():
        node = params["encoder"]["layers"]
        for key in ours:
            node = node[key]
        for leaf, hf_leaf in _leaf_names(kind):
            for i in range(config.num_layers):
                state[f"bert.encoder.layer.{i}.{theirs}.{hf_leaf}"] = _to_hf(
                    node[leaf][i], kind, leaf == "bias"
                )
    return state


def _pretraining_state(config: BertConfig, params: dict) -> dict[str, np.ndarray]:
    """Every tensor of a BertForPreTraining under its transformers name."""
    state = _encoder_state(config, params)
    for (ours,), (theirs, kind) in _HEADS.items():
        for leaf, hf_leaf in _leaf_names(kind):
            state[f"{theirs}.{hf_leaf}"] = _to_hf(params["heads"][ours][leaf], kind, leaf == "bias")
    state["cls.predictions.bias"] = params["heads"]["mlm_bias"]
    state["cls.predictions.decoder.weight"] = params["embeddings"]["word"]["embedding"]
    state["cls.predictions.decoder.bias"] = params["heads"]["mlm_bias"]
    return state


def unexportable_reason(config: BertConfig) -> str | None:
    """Why transformers' BERT cannot represent this model exactly, or None if it can.

    Its blocks are PostLN, and every LayerNorm normalizes: no choice of LayerNorm parameters
    turns it into the scale-and-bias of a model trained without normalization (the
    standardization loss), so such a model is refused rather than exported wrongly.
    """
    if config.layer_norm != "post":
        return "transformers BERT is PostLN: a layer_norm='pre' model cannot export"
    if config.normalization != "layer_norm":
        return (
            f"transformers BERT always applies LayerNorm: a model with "
            f"normalization={config.normalization!r} (trained with the standardization loss) "
            f"has no exact transformers form and cannot export"
        )
    return None


def save_safetensors(state: dict[str, np.ndarray], path: str) -> None:
    """safetensors writes its file with mode 0600; this gives it the mode any other new file
    gets (0666 less the umask), so that whoever may read config.json may read the weights."""
    from safetensors.numpy import save_file

    save_file(state, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def to_transformers(
    config: BertConfig, params: dict, path: str, vocab_file: str | None = None
) -> None:
    """Writes a directory that `transformers.BertForPreTraining.from_pretrained` loads."""
    reason = unexportable_reason(config)
    if reason:
        raise ValueError(reason)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    state = _pretraining_state(config, params)
    os.makedirs(path, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    save_safetensors(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(config), f, indent=2)
    if vocab_file:
        shutil.copyfile(vocab_file, os.path.join(path, "vocab.txt"))


# ----------------------------------------------------------------------------------------
# Fine-tuned models: the task heads of lambjax.models.heads


def to_transformers_task(
    config: BertConfig,
    params: dict,
    path: str,
    *,
    labels: tuple | list | None = None,
    vocab_file: str | None = None,
    lower_case: bool | None = None,
) -> None:
    """Writes a fine-tuned model for `BertForQuestionAnswering` (a span head,
    heads/qa_outputs) or `BertForSequenceClassification` (heads/pooler + heads/classifier;
    `labels` names the classes, one output is regression). With `vocab_file` and
    `lower_case`, the tokenizer's files too (save_tokenizer)."""
    reason = unexportable_reason(config)
    if reason:
        raise ValueError(reason)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    state = _encoder_state(config, params)
    head = params["heads"]
    hf_config = config_to_hf(config)
    if "qa_outputs" in head:
        state["qa_outputs.weight"] = head["qa_outputs"]["kernel"].T
        state["qa_outputs.bias"] = head["qa_outputs"]["bias"]
        hf_config["architectures"] = ["BertForQuestionAnswering"]
    elif "classifier" in head:
        for name, ours in (("bert.pooler.dense", "pooler"), ("classifier", "classifier")):
            state[f"{name}.weight"] = head[ours]["kernel"].T
            state[f"{name}.bias"] = head[ours]["bias"]
        num_labels = head["classifier"]["bias"].shape[0]
        names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(num_labels)]
        if len(names) != num_labels and not (num_labels == 1 and not labels):
            raise ValueError(f"labels {names} do not match the classifier's {num_labels} outputs")
        hf_config.update(
            architectures=["BertForSequenceClassification"],
            id2label={str(i): n for i, n in enumerate(names)},
            label2id={n: i for i, n in enumerate(names)},
            problem_type="regression" if num_labels == 1 else "single_label_classification",
        )
    else:
        raise ValueError(f"params['heads'] has {sorted(head)}: no span or classifier head")
    os.makedirs(path, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    save_safetensors(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    if vocab_file:
        shutil.copyfile(vocab_file, os.path.join(path, "vocab.txt"))
        if lower_case is not None:
            save_tokenizer(path, vocab_file, lower_case, config.max_position_embeddings)


SPECIAL_TOKENS = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}


def save_tokenizer(path: str, vocab_file: str, lower_case: bool, max_length: int) -> None:
    """The files `transformers.AutoTokenizer` needs to tokenize as lambjax does: vocab.txt,
    tokenizer.json (the `tokenizers` WordPiece tokenizer lambjax uses), tokenizer_config.json
    (casing, special tokens, maximum length) and special_tokens_map.json."""
    import tokenizers

    os.makedirs(path, exist_ok=True)
    if not os.path.exists(os.path.join(path, "vocab.txt")):
        shutil.copyfile(vocab_file, os.path.join(path, "vocab.txt"))
    tokenizers.BertWordPieceTokenizer(vocab_file, lowercase=lower_case).save(
        os.path.join(path, "tokenizer.json")
    )
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": lower_case,
        # None: accents are stripped exactly when lower-casing (BERT's and `tokenizers`' rule).
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "model_max_length": max_length,
        **SPECIAL_TOKENS,
    }
    for name, content in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", SPECIAL_TOKENS),
    ):
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)


def from_transformers_task(path: str) -> tuple[BertConfig, dict, list | None]:
    """Imports a `BertForQuestionAnswering` or `BertForSequenceClassification` directory:
    (config, params with the head under `heads`, class names or None)."""
    config, params = from_transformers(path)
    state = load_state_dict(path)
    if "qa_outputs.weight" in state:
        head = {
            "qa_outputs": {
                "kernel": state["qa_outputs.weight"].T.astype(np.float32),
                "bias": state["qa_outputs.bias"].astype(np.float32),
            }
        }
        labels = None
    elif "classifier.weight" in state:
        head = {
            "pooler": params["heads"]["pooler"],
            "classifier": {
                "kernel": state["classifier.weight"].T.astype(np.float32),
                "bias": state["classifier.bias"].astype(np.float32),
            },
        }
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            id2label = json.load(f).get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)] or None
    else:
        raise ValueError(f"{path}: neither qa_outputs nor classifier weights (no task head)")
    return (
        config,
        {"embeddings": params["embeddings"], "encoder": params["encoder"], "heads": head},
        labels,
    )
