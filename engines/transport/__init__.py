"""Weight transport: the trainer's weights streamed into running rollout engines, no restart.

`wire`: buckets, process groups, sending and receiving; `sync`: who sends to whom, over which backend
(gloo, nccl, CUDA IPC). Both ends call it (training sends, rollout receives); it knows neither.
"""
