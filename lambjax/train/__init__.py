"""Training: config, pure train/eval steps, checkpoints, metrics and the phase loop."""
