"""The garbage collector around a vLLM engine's build and close, in a process that builds one engine after another.

vLLM collects the whole heap five times while it builds an engine (twice freeing transient tensors as it loads
the weights, three times as it freezes its heap: vllm/utils/gc_utils.py) and twice as it shuts one down (its
engine core's, then its distributed clean-up's). A process that has torch, transformers and vLLM loaded holds
some 700k objects: each full collection is 0.5-0.8 s of CPU on 2 cores, paid by the run's evaluation host at
every evaluation (engines/rollout/host.py). bench/startup/engine_build.py measures both.

- `frozen_for_build()`: what the process holds before the build is frozen (`gc.freeze`), so the build's
  collections scan only what the build makes. vLLM's shutdown unfreezes it again.
- `one_collection_for_close()`: the shutdown's collections are put off to one, after the engine is dropped;
  they ran while it was still held, so they could not free it anyway (not for a sleep-mode engine, whose
  shutdown needs its own). That one collection frees the engine's cycles and the garbage from before the
  build, and only then is the device's cached memory released, as vLLM's clean-up does after its own.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_for_build() -> Iterator[None]:
    """Everything tracked so far frozen while an engine builds; unfrozen again where the build fails (a
    successful build's engine unfreezes it as it shuts down)."""
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


@contextlib.contextmanager
def one_collection_for_close(put_off: bool = True) -> Iterator[None]:
    """Inside, `gc.collect()` collects nothing (the callers' module attribute is swapped: vLLM calls
    `gc.collect()`); on the way out, one full collection, then on a GPU the device's and pinned host memory's
    caches emptied. `put_off=False` leaves the collections inside as they are and collects once more after
    them: a sleep-mode engine's shutdown frees its memory pools in an order that needs its own collection
    between them (vLLM's CuMemAllocator.release_pools)."""
    if put_off:
        gc.collect = _put_off
    try:
        yield
    finally:
        gc.collect = _COLLECT
        _COLLECT()
        import torch

        if torch.cuda.is_available():  # vLLM's clean-up emptied these while the engine was still held
            torch.cuda.empty_cache()
            empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # pinned host memory
            if empty_host_cache is not None:
                empty_host_cache()


_COLLECT = gc.collect  # restored as it was at import, however closes in two threads interleave


def _put_off(generation: int = 2) -> int:
    return 0
