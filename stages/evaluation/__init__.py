"""Held-out evaluation (``eval``): the rollout stage whose worker 0 also evaluates
(``stage.py``), what it evaluates and how (``evaluator.py``) and the pure metrics
(``metrics.py``: pass@k, aggregation). This room sits above ``rollout``, ``rewards`` and
``data``: it reads held-out rows as the source does and scores them with the reward
stage's own functions; nothing below imports it.
"""
