"""Models: the embedded tiny policy, real-shape checkpoints, weight names, completion
log-probs, and the reference stage that scores with a frozen copy."""
