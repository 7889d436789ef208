"""lambjax: large-batch BERT pretraining (LAMB, LANS) in JAX/Flax."""

import setuptools

INSTALL_REQUIRES = [
    "jax>=0.10,<0.11",
    "flax>=0.12,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.12,<0.13",
    "tensorflow-datasets>=4.9,<4.10",
    "importlib_resources",  # needed by tensorflow-datasets builders, not declared by it
    "grain>=0.2,<0.3",
    "array-record>=0.5",
    "ml_collections>=1,<2",
    # clu's metric writers need TensorFlow's summary ops and TensorBoard.
    "clu==0.0.12",
    "tensorflow-cpu>=2.16,<3",
    "tensorboard>=2.16,<3",
    "tokenizers>=0.20,<1",
    "safetensors>=0.4",
    "numpy>=1.26",
    "absl-py>=1.4",
]

EXTRAS_REQUIRE = {
    # Import from / export to PyTorch `transformers` checkpoints.
    "hf": ["torch==2.13.0", "transformers>=5,<6"],
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",
        "ruff>=0.6",
        "torch==2.13.0",
        "transformers>=5,<6",
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
)
