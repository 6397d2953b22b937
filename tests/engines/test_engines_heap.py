"""engines/heap.py: the collector around an engine's build and close (vLLM's collections, here a stand-in's)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest

from engines.heap import frozen_for_build, one_collection_for_close


class Cycle:
    def __init__(self, flag: list):
        self.me, self.flag = self, flag

    def __del__(self):
        self.flag.append("collected")


@contextlib.contextmanager
def full_collections() -> Iterator[list[int]]:
    """The full collections started inside, one entry each, with the automatic collector off (only explicit
    calls collect)."""
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            runs.append(1)

    gc.disable()
    gc.callbacks.append(count)
    try:
        yield runs
    finally:
        gc.callbacks.remove(count)
        gc.enable()


@pytest.mark.parametrize("fails", [False, True])
def test_a_close_collects_once_after_what_it_drops_whatever_it_calls_inside(fails):
    """A shutdown that calls gc.collect() twice while the engine is still held (as vLLM's does) collects
    nothing then; the engine's cycle goes in the one collection on the way out, a failing close included,
    and gc.collect is itself again."""
    flag: list[str] = []
    collect = gc.collect
    with full_collections() as runs:
        engine = Cycle(flag)
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            with one_collection_for_close():
                assert gc.collect() == 0 and gc.collect() == 0  # the shutdown's, the engine held
                del engine
                assert flag == [] and runs == []
                if fails:
                    raise RuntimeError("the shutdown failed")
        assert flag == ["collected"] and runs == [1]
        assert gc.collect is collect


def test_what_a_build_finds_is_frozen_and_a_failed_build_unfreezes_it():
    gc.unfreeze()
    with frozen_for_build():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0  # the engine's shutdown unfreezes it (vLLM's)
    gc.unfreeze()
    with pytest.raises(ValueError), frozen_for_build():
        raise ValueError("the build failed")
    assert gc.get_freeze_count() == 0


def test_a_close_on_memory_pools_keeps_its_own_collections_and_adds_one():
    """`put_off=False` (a sleep-mode engine, whose pools' release collects between two steps): the collections
    inside run, and one more follows."""
    flag: list[str] = []
    with full_collections() as runs:
        engine = Cycle(flag)
        with one_collection_for_close(put_off=False):
            del engine
            gc.collect()
            assert flag == ["collected"] and runs == [1]
        assert runs == [1, 1]
