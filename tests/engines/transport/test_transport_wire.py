"""The weight transport's parts without Ray: bucket plans, packing, a real gloo group of three ranks."""

from __future__ import annotations

import threading

import pytest
import torch

from alignflow.net import free_port
from engines.transport.wire import (ALIGN, TransportGroup, WeightSyncError, check_specs, pack, plan_buckets,
                                    receive_buckets, send_buckets, unpack)

STATE = {
    "embed": torch.randn(50, 16),  # 3200 bytes
    "norm": torch.randn(16),  # 64
    "steps": torch.arange(5, dtype=torch.int64),  # 40
    "half": torch.randn(3, 7).to(torch.bfloat16),  # 42: an odd size, the next offset must realign
    "proj": torch.randn(16, 16),  # 1024
}


def _specs(state):
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def test_buckets_keep_order_align_offsets_and_respect_the_size():
    buckets = plan_buckets(_specs(STATE), 1200)
    # Worked by hand: embed (3200) alone exceeds 1200 and travels alone; norm at 0, steps at 64,
    # half at 128 (ends 170); proj (1024) would end at 192 + 1024 > 1200: a new bucket.
    assert [b.names for b in buckets] == [["embed"], ["norm", "steps", "half"], ["proj"]]
    assert [[s.offset for s in b.slots] for b in buckets] == [[0], [0, 64, 128], [0]]
    assert [b.nbytes for b in buckets] == [3200, 170, 1024]
    assert all(s.offset % ALIGN == 0 for b in buckets for s in b.slots)
    # One bucket holds everything when it is large enough.
    assert len(plan_buckets(_specs(STATE), 2**20)) == 1
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(_specs(STATE), 0)


def test_pack_and_unpack_give_back_every_tensor_exactly():
    for bucket in plan_buckets(_specs(STATE), 1200):
        buf = pack(bucket, STATE, "cpu")
        for name, t in unpack(bucket, buf):
            assert t.dtype == STATE[name].dtype and torch.equal(t, STATE[name]), name
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="does not match the plan"):
        pack(plan_buckets(_specs(STATE), 2**20)[0], {**STATE, "norm": torch.randn(17)}, "cpu")


def test_a_gloo_group_streams_every_bucket_to_every_receiver():
    """Rank 0 sends, ranks 1 and 2 receive (threads of this process, a real gloo group over TCP).
    The receivers keep every view until the end: a buffer reused between buckets would show."""
    specs = _specs(STATE)
    buckets = plan_buckets(specs, 1200)
    address, world = ("127.0.0.1", free_port()), 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        try:
            group = TransportGroup(address, rank, world, "gloo", timeout_s=60)
            received[rank] = dict(receive_buckets(group, buckets, "cpu"))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = TransportGroup(address, 0, world, "gloo", timeout_s=60)
    sent = send_buckets(sender, buckets, lambda b, out: pack(b, STATE, "cpu", out))
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sent == sum(v.numel() * v.element_size() for v in STATE.values())
    for rank in (1, 2):
        assert list(received[rank]) == list(STATE)
        for name, value in STATE.items():
            assert torch.equal(received[rank][name], value), (rank, name)


def test_a_plan_that_does_not_fit_the_engine_is_rejected_with_its_differences():
    expected = {k: tuple(v.shape) for k, v in STATE.items()}
    check_specs(expected, _specs(STATE), "engine")  # the same names and shapes pass
    cases = [
        ({k: v for k, v in STATE.items() if k != "norm"}, "missing=['norm']"),
        ({**STATE, "extra": torch.zeros(2)}, "unknown=['extra']"),
        ({**STATE, "proj": torch.zeros(16, 8)}, "proj: (16, 8) != (16, 16)"),
    ]
    for state, detail in cases:
        with pytest.raises(WeightSyncError, match="rejected before sending") as err:
            check_specs(expected, _specs(state), "engine")
        assert detail in str(err.value)
    with pytest.raises(WeightSyncError, match="repeated"):
        check_specs(expected, _specs(STATE) + [("norm", (16,), "float32")], "engine")


def test_a_sender_that_stops_mid_update_fails_the_receiver_after_the_timeout():
    """The first bucket arrives; the sender then stops (a trainer that died mid-update). The receiver raises
    in its own call once the group's timeout has passed, instead of waiting on forever."""
    import time

    specs = _specs(STATE)
    buckets = plan_buckets(specs, 1200)
    assert len(buckets) == 3
    address, got, errors = ("127.0.0.1", free_port()), [], []

    def receiver() -> None:
        group = TransportGroup(address, 1, 2, "gloo", timeout_s=2)
        started = time.monotonic()
        try:
            for name, _ in receive_buckets(group, buckets, "cpu"):
                got.append(name)
        except RuntimeError as e:
            errors.append((e, time.monotonic() - started))

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = TransportGroup(address, 0, 2, "gloo", timeout_s=2)
    send_buckets(sender, buckets[:1], lambda b, out: pack(b, STATE, "cpu", out))  # one bucket of three, then nothing
    thread.join(60)
    assert not thread.is_alive() and got == ["embed"], got
    (error, waited), = errors
    assert 2 <= waited < 30 and "timed out" in str(error).lower(), (waited, error)
