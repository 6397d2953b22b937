"""Advantages: the estimators (one registry), their group baselines and returns, reward shaping, DAPO filters."""
