"""The toy job's lengths for tests that build a config from the defaults.

The defaults suit a real checkpoint (``data.max_prompt_len`` and ``rollout.max_tokens``
512); the embedded tiny model's tasks need a few tokens, as in ``configs/quickstart.yaml``.
"""

TOY = ["data.max_prompt_len=64", "rollout.max_tokens=8"]
