"""Rewards: reward-function adapters and the reward stage (``reward``), the reward-model
scorer and its embedded tiny model, reward shaping (group filters), and the built-in
verifiable rewards."""
