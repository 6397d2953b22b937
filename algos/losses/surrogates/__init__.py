"""Policy surrogates beside PPO's clip (algos/losses/policy.py): sequence ratios (GSPO), a geometric mean (GMPO),
clipped detached weights (CISPO), soft gates (SAPO), none at all (the plain policy gradient, GPG's), and the
covariance controls of entropy (Clip-Cov, KL-Cov)."""
