"""lambjax: large-batch BERT pretraining (LAMB, LANS) in JAX/Flax."""

__version__ = "0.1.0"
