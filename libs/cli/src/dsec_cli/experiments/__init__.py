"""``dsec experiment``: A/B runs over recorded inputs (docs/experiments.md)."""
