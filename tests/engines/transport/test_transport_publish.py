"""A published update (asynchronous rounds): sent from a thread once every engine has counted itself in, and
received by each engine only then, however long another engine is still generating."""

from __future__ import annotations

import threading
import time

import torch

from alignflow.net import free_port
from engines.transport.sync import count_in, publish
from engines.transport.wire import TransportGroup, pack, plan_buckets, receive_buckets

STATE = {"embed": torch.randn(50, 16), "norm": torch.randn(16), "proj": torch.randn(16, 16)}
TIMEOUT_S = 5.0  # the transport's timeout here (rendezvous and every call, on a loaded machine); one engine
GENERATING_S = 12.0  # generates for longer than it


def test_an_engine_that_takes_an_update_early_waits_for_a_slower_engine_past_the_transport_timeout():
    """Engine 1 is idle and takes the update at once; engine 2 is still generating for 12 s, more than the
    group's timeout, and takes it after. Engine 1's receive must not begin before engine 2 counts itself in:
    begun at once, it would wait under the timeout for a sender that waits for engine 2, and fail."""
    specs = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in STATE.items()]
    buckets = plan_buckets(specs, 1200)
    address, world = ("127.0.0.1", free_port()), 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    counted_in: dict[int, float] = {}
    errors: list[BaseException] = []

    def engine(rank: int, generating_s: float) -> None:
        try:
            group = TransportGroup(address, rank, world, "gloo", timeout_s=TIMEOUT_S)  # joined at the round's start
            time.sleep(generating_s)  # the generations queued before the update
            counted_in[rank] = time.monotonic()
            count_in(group.store, 1, 1, world)
            received[rank] = dict(receive_buckets(group, buckets, "cpu"))
        except BaseException as e:  # surfaced below
            errors.append(e)

    engines = [threading.Thread(target=engine, args=(1, 0.0)), threading.Thread(target=engine, args=(2, GENERATING_S))]
    for t in engines:
        t.start()
    sender = TransportGroup(address, 0, world, "gloo", timeout_s=TIMEOUT_S)
    thread, send_errors = publish(sender, 1, buckets, {id(b): pack(b, STATE, "cpu", None) for b in buckets})
    for t in engines + [thread]:
        t.join(60)
    assert not errors and not send_errors, errors + send_errors
    assert counted_in[2] - counted_in[1] > TIMEOUT_S  # engine 1 waited longer than its transport's timeout
    for rank in (1, 2):
        assert {k: torch.equal(v, STATE[k]) for k, v in received[rank].items()} == {k: True for k in STATE}
