"""The RL round: rollouts, rewards, the algorithm's update, weight sync, step after step.

`round.RLRound` moves batches; `round_models` starts the round's actors from its algorithm spec;
`updates` has one update class per spec kind; `experience` is pure functions over a frozen Experience;
`scoring` (reference and reward-model actors, also used by evaluation) and `rewards` (rule, remote)
score. The top of engines/: it uses train, rollout, transport and placement; nothing there uses it.
"""
