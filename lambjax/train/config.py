"""The experiment config: its fields and the building blocks the files in configs/ share.
lambjax.train.plan resolves it, checked, into the plans the code below runs on.

A config is an `ml_collections.ConfigDict`:

  seed, workdir-independent run settings (log/eval/checkpoint intervals, ...)
  model:      a preset name plus field overrides for `lambjax.models.config.BertConfig`
  data:       `lambjax.data.default_config()` (source, vocab, ...)
  optimizer:  the default optimizer of every phase (name, betas, weight decay, clipping)
  mesh:       the default device mesh of every phase ({data, fsdp, tensor, stage} sizes;
              -1 = rest), and `mesh.dcn`: the TPU slices each axis spans (lambjax.sharding)
  gradient_reduction: each_microbatch | once (lambjax.train.reduction)
  layer_drop: progressive layer dropping (off by default; lambjax.train.layer_drop)
  standardization_loss: its weight (0: off) and site (lambjax.models.standardization)
  step_method: the module of a method that replaces the train step ("" = the core step;
              lambjax.train.method), with the fields that method adds (e.g. Ouroboros')
  phases:     name -> phase (sequence length, global batch, accumulation, steps, schedule,
              optional `optimizer` / `mesh` overrides, and the encoder depth and frozen
              bottom layers of a multi-stage layerwise training stage: lambjax.train.layerwise)
  phase_order: the phase names in the order they run.
  tracking:   where the run's metrics go besides TensorBoard (lambjax.train.tracking)
  init:       a published model the first phase starts from (lambjax.train.published)

The recipes are the files in configs/; the variants every config accepts (`runlocal`, `pld`,
`mslt`, `chunked_accumulation`, `standardization_loss`, `ouroboros`) are in
lambjax.train.variants.
"""

import ml_collections

from lambjax import data as data_lib
from lambjax.models.config import PRESETS

OPTIMIZERS = ("lamb", "lans", "adamw")
SCHEDULES = ("poly_warmup", "warmup_constant_decay", "constant")
OPTIMIZER_STATE_AT_PHASE_START = ("keep", "reset")


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the valid values."""


def optimizer_config(name: str = "lamb") -> ml_collections.ConfigDict:
    """NVIDIA's BERT recipe settings; `lans` takes the same fields where they apply."""
    return ml_collections.ConfigDict(
        {
            "name": name,
            "b1": 0.9,
            "b2": 0.999,
            "eps": 1e-6,
            "weight_decay": 0.01,
            # Global gradient-norm pre-clip (NVIDIA and the LANS scripts: 1.0); None = off.
            "max_global_norm": 1.0,
            # LAMB only: no trust ratio for biases and LayerNorm (NVIDIA's recipe). False
            # gives the paper's / optax's LAMB, where every tensor gets a ratio.
            "exclude_norms_and_biases_from_trust_ratio": True,
            "bias_correction": True,
            # Where the layers are held one tree per layer (unrolled): update them stacked by
            # role, a few kernels per role instead of per leaf (lambjax.optim.stacking).
            "group_layers": False,
        }
    )


def _unset_fields(example) -> ml_collections.ConfigDict:
    """The same fields, each None (settable from the command line with its type)."""
    return ml_collections.ConfigDict(
        {
            k: ml_collections.FieldReference(None, field_type=type(v) if v is not None else float)
            for k, v in dict(example).items()
        }
    )


def phase_config(
    *,
    max_seq_length: int,
    max_predictions_per_seq: int,
    global_batch_size: int,
    num_steps: int,
    learning_rate: float,
    schedule: str = "poly_warmup",
    warmup_fraction: float = 0.01,
    constant_fraction: float = 0.0,
    grad_accum_steps: int | None = None,
    micro_batch_per_device: int | None = None,
    optimizer_state: str = "keep",
    num_layers: int | None = None,
    frozen_layers: int = 0,
    train_decoder: bool = False,
    continue_schedule: bool = False,
) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {
            "max_seq_length": max_seq_length,
            "max_predictions_per_seq": max_predictions_per_seq,
            "global_batch_size": global_batch_size,
            # The gradient accumulation: `grad_accum_steps` micro-batches per step where it
            # is given; else derived from the rows each data-parallel device computes at once,
            # global_batch_size / (micro_batch_per_device x data-parallel devices), so that
            # one recipe fits any pod; with neither, 1.
            "grad_accum_steps": ml_collections.FieldReference(grad_accum_steps, field_type=int),
            "micro_batch_per_device": ml_collections.FieldReference(
                micro_batch_per_device, field_type=int
            ),
            "num_steps": num_steps,
            "learning_rate": learning_rate,
            "schedule": schedule,
            "warmup_fraction": warmup_fraction,
            "constant_fraction": constant_fraction,
            # NVIDIA: poly power 0.5; LANS: linear decay (degree 1).
            "decay_power": 0.5 if schedule == "poly_warmup" else 1.0,
            # At the start of a later phase: keep the previous phase's moments (with the
            # step count and bias correction restarted, as NVIDIA's phase 2) or start fresh.
            "optimizer_state": optimizer_state,
            # Multi-stage layerwise training: this phase's encoder depth (None: the model's)
            # and how many bottom layers run forward only (not trained, no optimizer state).
            # A deeper phase than the one before grows the encoder by copying its top layers.
            "num_layers": ml_collections.FieldReference(num_layers, field_type=int),
            "frozen_layers": frozen_layers,
            # With frozen layers: train the tied MLM decoder (the word-embedding matrix)
            # through the output projection only (the input lookup stays frozen).
            "train_decoder": train_decoder,
            # Continue the previous phase's warm-up and decay (one schedule over both) rather
            # than re-warming; the schedule settings must be the same.
            "continue_schedule": continue_schedule,
            # Overrides of the top-level optimizer / mesh for this phase only (None: inherit),
            # e.g. --config.phases.phase2.optimizer.name=lans.
            "optimizer": _unset_fields(optimizer_config()),
            "mesh": _unset_fields({"data": 1, "fsdp": 1, "tensor": 1, "stage": 1}),
        }
    )


def _method_fields(config: ml_collections.ConfigDict) -> None:
    """The seed papers' methods and the run's measures, all off by default: layer dropping,
    the standardization loss, a step method, the gradient noise scale and a target."""
    # Progressive layer dropping (needs model layer_norm="pre"): keep probability
    # theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar, t = optimizer steps of the run;
    # depth_rule "deepspeed" (the authors' code: the first layer is never dropped) or "paper".
    config.layer_drop = ml_collections.ConfigDict(
        {"enabled": False, "theta_bar": 0.5, "gamma": 0.001, "depth_rule": "deepspeed"}
    )
    # The standardization loss (Collins et al. 2019): weight lambda of L_std in the objective,
    # for a model with model.overrides.normalization="none"; 0 = off. site: where it
    # attaches, "residual" (the tensors the removed LayerNorms normalized) or
    # "preactivation" (each FFN's intermediate output before GELU, as in the paper).
    config.standardization_loss = ml_collections.ConfigDict({"weight": 0.0, "site": "residual"})
    # A method that replaces the train step: the module that provides it (lambjax.train.method),
    # e.g. "lambjax.contrib.ouroboros", which adds its own fields; "" = the core step.
    config.step_method = ""
    # The gradient noise scale B_simple (lambjax.train.noise_scale), logged as
    # train/noise_scale: needs grad_accum_steps >= 2 in every phase. ema_decay: per step,
    # of the averages of its numerator and denominator.
    config.noise_scale = ml_collections.ConfigDict({"enabled": False, "ema_decay": 0.95})
    # End the run at the first held-out evaluation whose metric reaches `value`
    # (lambjax.train.target): "mlm_loss" at or below it, "mlm_accuracy" or "nsp_accuracy" at
    # or above (MLPerf's BERT: mlm_accuracy 0.720); "" = every phase to its last step.
    config.target = ml_collections.ConfigDict({"metric": "", "value": 0.0})


def base_config() -> ml_collections.ConfigDict:
    """Fields every experiment has, with the embedded tiny demo's values."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    # The PRNG of dropout and the other training draws (lambjax.train.prng): threefry,
    # rbg or unsafe_rbg.
    config.prng_impl = "threefry"
    config.model = ml_collections.ConfigDict(
        {
            "preset": "tiny",
            # Fields of BertConfig to override; vocab_size defaults to the data's vocab.
            # `attention` and `gelu_approximate` are here so that
            # --config.model.overrides.attention=... can set them.
            "overrides": ml_collections.ConfigDict(
                {"dtype": "bfloat16", "attention": "auto", "gelu_approximate": False}
            ),
        }
    )
    config.data = data_lib.default_config()
    config.optimizer = optimizer_config("lamb")
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "stage": 1})
    # On several TPU slices: how many each axis spans, the rest of it within every slice (their
    # product is the slice count; e.g. dcn.data=2: data parallel across two slices).
    config.mesh.dcn = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1, "stage": 1})
    # Where the gradient is summed over the mesh axis `data` (lambjax.train.reduction):
    # "each_microbatch" (XLA's choice: inside the micro-batch loop) or "once" per step.
    config.gradient_reduction = "each_microbatch"
    _method_fields(config)
    config.phases = ml_collections.ConfigDict()
    config.phase_order = ()
    config.log_every_steps = 10
    config.eval_every_steps = 100
    config.eval_batch_size = 32
    # Validation batches per evaluation; 0 = the whole held-out split, every example once
    # (the last batch padded with rows of zero weight; eval/examples logs how many).
    config.eval_steps = 0
    # Also evaluate before the run's first step (a continued pretraining's starting loss: the
    # published model's on the new text), logged at step 0.
    config.eval_at_start = False
    config.checkpoint_every_steps = 100
    # Also save once this many minutes of wall time have passed since the last save (checked
    # at log steps, decided by process 0 for all): a preemption without notice then loses at
    # most about this much work. 0 = by steps only.
    config.checkpoint_every_minutes = 30.0
    config.max_checkpoints_to_keep = 3
    config.async_checkpointing = True
    # Stop when this many consecutive steps had a non-finite loss or gradient.
    config.max_consecutive_nonfinite_steps = 10
    # Peak FLOP/s of one device, for MFU; 0 = look up by device kind (unknown: no MFU).
    config.peak_flops_per_device = 0.0
    # Trace 5 steps of each phase (from its 6th) with the JAX profiler into the workdir.
    config.profile = False
    # Experiment tracking (lambjax.train.tracking): backends "", "wandb", "mlflow" or
    # "wandb,mlflow"; the W&B project / MLflow experiment; the run's name ("": the workdir's
    # last folder) and group (a sweep sets both).
    config.tracking = ml_collections.ConfigDict(
        {"backends": "", "project": "lambjax", "run_name": "", "group": ""}
    )
    # Where the first phase starts (lambjax.train.published): "" (random weights), or a
    # published model whose vocabulary, casing and shape the run then takes: hf:DIR (a
    # transformers BERT), tf:DIR (Google's original TensorFlow checkpoint) or workdir:PATH
    # (another lambjax run).
    config.init = ""
    return config


def pod_config(preset: str) -> ml_collections.ConfigDict:
    """The fields of a pod-scale BERT run that are not the optimizer recipe: BERT's
    vocabulary size, Wikipedia as the corpus, and log/eval/checkpoint intervals."""
    config = base_config()
    config.model.preset = preset
    config.data.source = "tfds:wikipedia/20230601.en"
    config.data.vocab_size = 30522
    config.log_every_steps = 10
    config.eval_every_steps = 500
    config.eval_batch_size = 1024
    config.eval_steps = 10
    config.checkpoint_every_steps = 200
    return config


def with_phases(config: ml_collections.ConfigDict, **phases) -> ml_collections.ConfigDict:
    """Sets `config.phases` and `config.phase_order` from keyword arguments, in order."""
    config.phases = ml_collections.ConfigDict(phases)
    config.phase_order = tuple(phases)
    return config


def model_depth(config) -> int:
    """The encoder depth of `config.model` (before any phase sets its own), for variants that
    shape a recipe by it."""
    if config.model.preset not in PRESETS:
        raise ConfigError(f"config.model.preset={config.model.preset!r}; valid: {sorted(PRESETS)}")
    overrides = config.model.overrides
    if "num_layers" in overrides:
        return overrides.num_layers
    return PRESETS[config.model.preset]["num_layers"]
