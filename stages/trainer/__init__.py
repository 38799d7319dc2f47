"""The trainer: its stage (``stage``, and ``ppo`` with epochs and mini-batches), its
DeepSpeed engine (``engine``), data-parallel ranks (``ranks``), checkpoints, step metrics,
learning-rate schedules, and the PPO critic."""
