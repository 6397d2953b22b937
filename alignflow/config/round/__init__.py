"""An RL round's configuration: the round (rl.py) and the checks across its fields (checks.py), its rewards
(reward.py, a judge's in judge.py, how its verdicts read as scores in verdicts.py), its updates
(updates.py: KL and PPO) and its environment (agent.py)."""
