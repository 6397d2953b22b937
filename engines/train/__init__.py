"""Training: the DeepSpeed engine and what it runs.

The engine (`worker.TrainWorker` ranks driven as one `group.TrainerGroup`, built from a `spec.EngineSpec`,
its resume `state`) and the objectives it is handed (`objectives`, `packed_objectives`, `preference`),
with what they compute from (`logits`, `packing`, `shared_prefix`) and the supervised step loop
(`supervised`). It uses placement, transport and the shared model pieces; it never imports the RL round.
"""
