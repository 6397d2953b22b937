"""The SFT / reward-model step schedule: which rows each step takes, and what it never takes (counted)."""

from __future__ import annotations

import pytest
import torch

from engines.train.supervised import Schedule, plan


def _union(schedule: Schedule) -> set[int]:
    return {int(i) for step in range(schedule.total_steps) for i in schedule.indices(step)}


@pytest.mark.parametrize("rows, batch, epochs, max_steps", [
    (63, 32, 1, None),   # one whole batch: 31 rows never seen
    (10, 4, 2, None),    # 2 left per epoch, a different 2 each time
    (10, 4, 1.5, None),  # a fractional epoch: 3 steps
    (64, 32, 1, None),   # divides: nothing left
    (64, 8, 3, 5),       # max_steps cuts the first epoch short
])
def test_rows_never_trained_are_counted(rows, batch, epochs, max_steps):
    schedule = plan(rows, batch, epochs, max_steps, seed=3)
    seen = _union(schedule)
    assert schedule.never_trained() == rows - len(seen)
    assert schedule.left_per_epoch == rows % batch
    for step in range(schedule.total_steps):  # each step a whole batch of distinct rows
        idx = schedule.indices(step)
        assert len(idx) == batch and len(set(idx.tolist())) == batch


def test_the_message_says_how_many_of_how_many_and_why():
    schedule = plan(63, 32, 1, None, seed=0)
    assert schedule.never_trained() == 31
    assert schedule.left_out("rows", 31) == ("31 of 63 rows are never trained on: each epoch takes 1 whole batches "
                                             "of 32, leaving 31 out (a different set each epoch), over 1 steps")


def test_each_epoch_is_its_own_permutation_so_leftovers_differ():
    schedule = plan(10, 4, 3, None, seed=1)
    epochs = [schedule.order(e) for e in range(3)]
    left = [set(p[8:].tolist()) for p in epochs]
    assert len({frozenset(s) for s in left}) > 1
    assert all(sorted(p.tolist()) == list(range(10)) for p in epochs)
    assert torch.equal(schedule.indices(4), epochs[2][:4])  # step 4 is epoch 2's first batch


def test_fewer_rows_than_a_batch_is_the_users_error_naming_the_field():
    """Not retried (a ConfigError is a user error), and it names the config field and the rows it counted."""
    from alignflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^sft.batch_size: 4 is more than the 3 rows it trains on; lower it"):
        plan(3, 4, 1, None, seed=0, field="sft.batch_size", what="rows it trains on")
