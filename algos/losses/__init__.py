"""Losses: the policy surrogates (PPO clip, GSPO) with importance weights and entropy, preference, process-reward and distillation losses, and how a per-token loss is reduced."""
