"""Data: the prompt source and its readers (JSONL, Parquet, Hub), preference pairs,
curricula, built-in synthetic tasks, and the tools a model calls in multi-turn rollouts."""
