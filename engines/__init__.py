"""Compute behind small interfaces, as Ray actors, one room per role; arrows run down this list only:

    rl/          the RL round: rollouts, rewards, the algorithm's update, weight sync
    train/       the DeepSpeed training engine and the objectives it runs
    rollout/     rollout engines (vLLM, HF) and the actors that host them
    transport/   weights from the trainer into running engines
    placement/   devices, placement groups, where process groups meet

and, used on both sides: `models` (build, load, save), `lora`, `batches` (records -> token tensors,
micro-batches), `lengths` (token lengths of a dataset) and `lean_imports`.
"""
