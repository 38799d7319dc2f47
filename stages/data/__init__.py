"""Data: the prompt source and its readers (JSONL, Parquet, Hub), preference pairs,
curricula and the built-in synthetic tasks."""
