"""Training: optimizers and schedules, the pipeline engine, the trainer loop, checkpoints and metrics."""
