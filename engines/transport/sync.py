"""The weight transport between a round's processes: who sends, who receives, over which backend.

    choose_backend(...)  gloo on CPUs; nccl between GPUs; CUDA IPC where engine i shares rank i's GPU
    WeightSender         the trainer's side, on every rank (TrainWorker holds one)
    WeightSync           the driver's side: groups made once per round, then `push` per update
    push_state(...)      a state dict from this process into rollout actors (tests, checkpoints)

The wire format and the groups: engines/transport/wire.py; the receiving side: engines/rollout/vllm_engine.py.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence

import torch

from engines.transport.wire import Bucket, TensorSpec, TransportGroup, WeightSyncError, pack, plan_buckets, send_buckets

__all__ = ["WeightSender", "WeightSync", "choose_backend", "default_bucket_bytes", "gpu_id", "push_state"]


def default_bucket_bytes() -> int:
    """`generation.weight_bucket_mb`'s default, in bytes (the config holds the one default)."""
    from alignflow.config import GenerationConfig

    return int(GenerationConfig.model_fields["weight_bucket_mb"].default * 2**20)


def gpu_id(device: torch.device | str) -> str | None:
    """The UUID of `device`'s GPU (the same GPU has the same one in every process); None on the CPU."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def choose_backend(trainer_gpus: Sequence[str | None], engine_gpus: Sequence[Sequence[str | None]]) -> str:
    """The transport for where the processes are, by GPU identity: gloo where any side is on the CPU;
    CUDA IPC where engine i sits on trainer rank i's GPU (colocation); nccl where every engine worker
    has a GPU apart from trainer rank 0's and from each other's (NCCL cannot pair two processes on
    one device). Anything else is a placement the transport cannot serve: refused, with the layout."""
    workers = [g for engine in engine_gpus for g in engine]
    if trainer_gpus[0] is None or None in workers:
        return "gloo"
    if len(engine_gpus) == len(trainer_gpus) and all(list(e) == [t] for e, t in zip(engine_gpus, trainer_gpus)):
        return "ipc"
    if trainer_gpus[0] not in workers and len(set(workers)) == len(workers):
        return "nccl"
    raise WeightSyncError(f"rollout engines on GPUs {[list(e) for e in engine_gpus]} and trainer ranks on "
                          f"{list(trainer_gpus)}: sharing a GPU works only with one engine beside each trainer rank "
                          "(colocate_all); otherwise give the engines whole GPUs of their own")


IPC_UNPUBLISHED = ("async_rollouts publishes updates, which needs the rollout engines on GPUs apart from the trainers': "
                   "an engine on a trainer's GPU reads its update from the trainer's staging buffer, update by update")
PUBLISHED = "alignflow/published"  # the transport store's key: the version of the last update published


def taking(version: int) -> str:
    """The store key the engines count themselves into (by their ranks in the group) as they take `version`."""
    return f"alignflow/taking/{version}"


def announcements(address: tuple[str, int]):
    """A client of the transport group's store at `address` (its rank 0 serves it), to read announcements."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(address[0], int(address[1]), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def announced(store) -> int:
    """The version of the last update published on `store` (0: none yet)."""
    return int(store.get(PUBLISHED)) if store.check([PUBLISHED]) else 0


def wait_for_takers(store, version: int, receivers: int) -> None:
    """Until `receivers` ranks have counted themselves in as taking `version`, with no time limit: an engine
    counts itself in only once the generations queued before the update have ended. A peer that dies takes
    the store's connection down, and this wait with it."""
    while store.add(taking(version), 0) < receivers:
        time.sleep(0.005)


def count_in(store, version: int, ranks: int, world_size: int) -> None:
    """An engine's side of a published update, before its receive: its `ranks` count themselves in as taking
    `version`, then wait for every other engine's, as the sender does (`publish`). Its receive then starts
    with the update on the wire: one started at once would wait under the transport's timeout for the
    engine that counts itself in last, which may be generating for longer than that."""
    store.add(taking(version), ranks)
    wait_for_takers(store, version, world_size - 1)


def publish(group: TransportGroup, version: int, buckets: Sequence[Bucket], packed: dict[int, torch.Tensor]
            ) -> tuple[threading.Thread, list[BaseException]]:
    """Rank 0: announce `version` on the group's store, then send `packed` (bucket id -> its packed buffer)
    from a thread, once every receiving rank has counted itself in as taking it (RolloutActor.receive_weights),
    so that no collective waits on the wire, under the transport's timeout, for a generation to end: an
    engine takes an update after the generations queued before it, or between two pieces of one
    (engines/rollout/pieces.py). The thread, and the list its failure goes into."""
    group.store.set(PUBLISHED, str(version))
    errors: list[BaseException] = []
    device = group.device
    wire = device if group.backend == "nccl" else torch.device("cpu")  # a snapshot in host memory goes to the GPU

    def on_the_wire() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            wait_for_takers(group.store, version, group.world_size - 1)
            send_buckets(group, buckets, lambda b, out: packed.pop(id(b)).to(wire, non_blocking=True))
        except BaseException as err:  # raised by the sender's next `sent`
            errors.append(err)

    thread = threading.Thread(target=on_the_wire, name=f"weight-update-{version}", daemon=True)
    thread.start()
    return thread, errors


class WeightSender:
    """The trainer's side, on every rank. Under ZeRO-3 every rank gathers each bucket's parameters.
    Over gloo or nccl, rank 0 (the transport's rank 0) packs and sends every bucket to every engine;
    over CUDA IPC (colocated) each rank sends to the engine on its own GPU, in a group of two."""

    def __init__(self, module: torch.nn.Module, zero_stage: int, rank: int, device: torch.device):
        from engines import lora

        self.entries = {e.name: e for e in lora.weight_entries(module)}
        self.zero_stage, self.rank, self.device = zero_stage, rank, device
        self.group: TransportGroup | None = None
        self.buckets: list[Bucket] = []
        self._sending: tuple[threading.Thread, list[BaseException]] | None = None  # a published update on the wire

    def specs(self) -> list[TensorSpec]:
        return [(e.name, e.shape, str(e.dtype).removeprefix("torch.")) for e in self.entries.values()]

    def describe(self) -> dict:
        """What the driver needs to make the groups: the update's tensors and this rank's GPU."""
        return {"specs": self.specs(), "gpu": gpu_id(self.device)}

    def join(self, address: tuple[str, int], world_size: int, backend: str, bucket_bytes: int) -> None:
        """Every rank plans the buckets; the senders join their group (blocks until all have)."""
        self.buckets = plan_buckets(self.specs(), bucket_bytes)
        self._sending = None  # a new group: what an old one had on the wire is not waited for
        if self.rank == 0 or backend == "ipc":
            self.group = TransportGroup(address, 0, world_size, backend, self.device)

    def send(self, background: bool = False, version: int = 0) -> int:
        """One update: every bucket, in order. Bytes sent (0 on a rank that only gathers).

        `background` (asynchronous rounds, over gloo or nccl): every bucket is packed now, a snapshot of the
        weights (on the sending GPU where half its free memory holds it, else in pinned host memory), published
        as `version` (the engines' count of updates once they take it): a thread of this process sends it once
        the engines take it (`publish`), while the caller trains on. An update waits for the one before it."""
        from engines.lora import gathered

        self.sent()

        device = "cpu" if self.group is None or self.group.backend == "gloo" else self.device

        def params_of(bucket: Bucket) -> list[torch.nn.Parameter]:
            return list({id(p): p for n in bucket.names for p in self.entries[n].params}.values())

        def pack_bucket(bucket: Bucket, out: torch.Tensor | None) -> torch.Tensor:
            with torch.no_grad(), gathered(params_of(bucket), self.zero_stage):
                return pack(bucket, {n: self.entries[n].value() for n in bucket.names}, device, out)

        if self.group is None:  # ZeRO-3: the sender's gathers need this rank too
            for bucket in self.buckets:
                with gathered(params_of(bucket), self.zero_stage):
                    pass
            return 0
        if background:
            if self.group.backend == "ipc":
                raise WeightSyncError(IPC_UNPUBLISHED)
            on_host = device != "cpu" and torch.cuda.mem_get_info(device)[0] < 2 * sum(b.nbytes for b in self.buckets)
            packed = {id(b): pack_bucket(b, torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True) if on_host
                                         else None) for b in self.buckets}
            if self.group.device.type == "cuda":
                torch.cuda.current_stream(self.group.device).synchronize()  # packed before the thread sends it
            self._sending = publish(self.group, version, self.buckets, packed)
            return sum(s.nbytes for b in self.buckets for s in b.slots)
        sent = send_buckets(self.group, self.buckets, pack_bucket)
        if self.group.backend == "ipc":
            torch.cuda.empty_cache()  # colocated: the engine's KV cache may wake next, on this GPU
        return sent

    def sent(self) -> None:
        """Wait until a published update is sent (every engine has it, or is reading it); raise what it raised."""
        if self._sending is None:
            return
        (thread, errors), self._sending = self._sending, None
        thread.join()
        if errors:
            raise WeightSyncError(f"a published weight update failed: {errors[0]!r}") from errors[0]


def _taints_trainers(method):
    """A failure may leave trainers and engines mid-transfer: they end, not kept warm (engines/placement/warm.py)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.trainers.taint(), self.engines.taint()
            raise
    return call


class WeightSync:
    """The driver's side: a trainer group's weights into rollout engines, over transport groups made
    once (a round's first sync). Names and shapes are checked by every engine before anything is
    sent; each `push` is then one broadcast per bucket."""

    @_taints_trainers
    def __init__(self, trainers, engines, *, bucket_bytes: int, publish: bool = False):
        import ray

        self.trainers, self.engines = trainers, engines
        workers = trainers.workers
        ranks = ray.get([w.describe_weights.remote() for w in workers])
        specs = ranks[0]["specs"]
        engine_gpus = ray.get([e.prepare_weights.remote(specs, bucket_bytes) for e in engines.actors])
        backend = choose_backend([r["gpu"] for r in ranks], engine_gpus)
        if publish and backend == "ipc":  # refused here, at the round's start, not at its first update
            raise WeightSyncError(IPC_UNPUBLISHED)
        if backend == "ipc":  # trainer rank i -> the engine on its GPU: a group of two per rank
            addresses = ray.get([w.address.remote() for w in workers])
            joins = [w.join_transport.remote(a, 2, backend, bucket_bytes) for w, a in zip(workers, addresses)]
            joins += [e.join_transport.remote(a, 1, 2, backend) for e, a in zip(engines.actors, addresses)]
        else:  # rank 0 -> every engine worker
            counts = [len(g) for g in engine_gpus]
            world = 1 + sum(counts)
            address = ray.get(workers[0].address.remote())  # rank 0's node, a fresh free port
            joins = [w.join_transport.remote(address, world, backend, bucket_bytes) for w in workers]
            joins += [e.join_transport.remote(address, 1 + sum(counts[:i]), world, backend)
                      for i, e in enumerate(engines.actors)]
        ray.get(joins)
        self._receiving: list = []  # engines' refs of published updates not yet seen taken
        self._published = False  # an update was published and not yet settled

    @_taints_trainers
    def push(self, version: int | None = None, publish: bool = False) -> None:
        """One update, taken by every engine before it returns. `publish` (asynchronous rounds): returns once
        the engines took the update before it and the trainers have packed this one; they send it from a
        thread of their own, and each engine takes it after the generations already queued on it (engines run
        calls in order), so the samples of those carry the version before it, or between two pieces of one
        (partial rollouts). A failure is raised by the next push or by `settle`. `version`: the engines' count of updates once they hold this one (None: one
        more than they hold; a published update needs it, to be announced)."""
        import ray

        if not publish:
            self.settle()
            ray.get([w.send_weights.remote(False, version or 0) for w in self.trainers.workers]
                    + [e.receive_weights.remote(version) for e in self.engines.actors])
            return
        if version is None:
            raise ValueError("a published update needs its version")
        # The one before taken by every engine (after the generations queued before it): one update at a time
        # on the wire, and an engine that failed or died raises here, not in a sender waiting for it.
        receiving, self._receiving = self._receiving, []
        ray.get(receiving)
        ray.get([w.send_weights.remote(True, version) for w in self.trainers.workers])
        self._published = True
        self._receiving = [e.receive_weights.remote(version) for e in self.engines.actors]

    @_taints_trainers
    def settle(self) -> None:
        """Every published update taken by the engines, and off the trainers' threads (no call where none was
        published since the last)."""
        import ray

        if not self._published:
            return
        receiving, self._receiving, self._published = self._receiving, [], False
        ray.get(receiving + [w.weights_sent.remote() for w in self.trainers.workers])


def push_state(state: dict[str, torch.Tensor], receivers: Sequence, *, bucket_bytes: int | None = None) -> int:
    """Send `state` from this process (rank 0, gloo) into rollout actors (engines/rollout/actors.py):
    a checkpoint into engines without a trainer, and the transport's tests. Bytes sent."""
    import ray

    from engines.placement.rendezvous import reserve_address

    bucket_bytes = bucket_bytes or default_bucket_bytes()
    specs = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
    counts = [len(gpus) for gpus in ray.get([r.prepare_weights.remote(specs, bucket_bytes) for r in receivers])]
    address = reserve_address("127.0.0.1")  # this process serves the group's store
    world = 1 + sum(counts)
    joins = [r.join_transport.remote(address, 1 + sum(counts[:i]), world, "gloo") for i, r in enumerate(receivers)]
    group = TransportGroup(address, 0, world, "gloo")
    ray.get(joins)
    done = [r.receive_weights.remote() for r in receivers]
    sent = send_buckets(group, plan_buckets(specs, bucket_bytes), lambda b, out: pack(b, state, "cpu", out))
    ray.get(done)
    return sent
