"""Models: BERT for pretraining, and Hugging Face `transformers` interop (models.hf)."""
