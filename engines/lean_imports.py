"""A shorter start for every process that loads a model: transformers without scikit-learn and scipy,
vLLM without scipy and OpenCV, a trainer's DeepSpeed without MLflow, and no DeepSpeed at all where a
process that never trained saves a model.

transformers imports scikit-learn (and with it scipy and pandas) whenever the
package is installed, for one feature alignflow never calls: the dynamic
confidence threshold of assisted generation
(transformers/generation/candidate_generator.py). It imports scipy's optimizer,
whenever scipy is installed, as its model code loads, for the matching loss of
object-detection models (transformers/loss/loss_for_object_detection.py).
MLflow is why both are installed. `lean_transformers()`, called before
transformers loads its model code, makes both availability checks say no.

vLLM imports `scipy.signal` to resample audio and OpenCV to read video
(vllm/multimodal/audio.py, video.py), each guarded: where the import fails it
puts a placeholder in its place, which raises only if called. alignflow's
rollouts are text. `import_vllm()` loads vLLM with both hidden. On a 2-core
AMD EPYC the two were 1.5 s of a rollout engine's 17.7 s of imports, and
scipy 0.6 s of a trainer's 10.4 s (`bench/startup/imports.py`, median of 3).

DeepSpeed's autotuner imports MLflow, when it is installed, as DeepSpeed itself
loads (deepspeed/autotuning/autotuner.py), to log autotuning experiments;
alignflow never autotunes, and its trainers log nothing to MLflow (the stage's
task does). That import was about half of `import deepspeed` in each trainer
rank: 4 s of 8 s of CPU on the same machine. `import_deepspeed()` loads
DeepSpeed with MLflow hidden.

`model.save_pretrained` unwraps the model through accelerate, which imports all of
DeepSpeed to ask whether the model is a `DeepSpeedEngine`
(accelerate/utils/other.py: extract_model_from_parallel). A process that has not
loaded DeepSpeed holds no such engine: `deepspeed_left_unloaded()` makes the
check say no there, and the stage that builds or copies the base model saves it
without 3-4 s of CPU importing DeepSpeed (and, through its autotuner, MLflow).

Nothing else changes: a module hidden is hidden only while the import runs, so
`import scipy`, `import sklearn` or `import mlflow` in a user's reward function
or checker works as ever (tests/engines/test_engines_lean_imports.py). Each is
called where its process loads the library first, in an actor that runs one
call at a time: no other thread imports meanwhile.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

# The modules that bind the checks as they load: once either is loaded, patching the checks changes nothing.
_TOO_LATE = ("transformers.generation.candidate_generator", "transformers.loss.loss_for_object_detection")
_CHECKS = ("is_sklearn_available", "is_scipy_available")


def _absent() -> bool:
    return False


def lean_transformers() -> bool:
    """Whether transformers' model code will load without scikit-learn and scipy: False where that code
    was already imported (this process loaded it before calling here), or the checks have other names
    in this transformers version."""
    if any(m in sys.modules for m in _TOO_LATE):
        return "sklearn" not in sys.modules and "scipy" not in sys.modules
    import transformers.utils as utils
    from transformers.utils import import_utils

    if not all(hasattr(utils, name) and hasattr(import_utils, name) for name in _CHECKS):
        return False
    for name in _CHECKS:
        setattr(utils, name, _absent)
        setattr(import_utils, name, _absent)
    return True


@contextlib.contextmanager
def _hidden(*modules: str) -> Iterator[None]:
    """`import M` raises ImportError inside, for each of `modules` not already loaded; as before after."""
    hide = [m for m in modules if m not in sys.modules]
    for m in hide:
        sys.modules[m] = None
    try:
        yield
    finally:
        for m in hide:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def import_vllm():
    """`vllm`, with `vllm.LLM` loaded, without scipy and OpenCV where this process has not imported them
    already (then vLLM finds them loaded and they cost nothing). `vllm.platforms` may come first: it
    loads neither (the engine's device check, engines/rollout/engine_build.py:build_engine)."""
    if "vllm.entrypoints.llm" not in sys.modules:
        lean_transformers()
        with _hidden("scipy", "cv2"):
            from vllm import LLM  # noqa: F401
    import vllm

    return vllm


def import_deepspeed():
    """`deepspeed`, loaded without its autotuner's MLflow import where this process has not imported
    MLflow already (then DeepSpeed finds it loaded and it costs nothing)."""
    if "deepspeed" not in sys.modules:
        with _hidden("mlflow"):
            import deepspeed  # noqa: F401
    import deepspeed

    return deepspeed


@contextlib.contextmanager
def deepspeed_left_unloaded() -> Iterator[None]:
    """Inside, a process that has not loaded DeepSpeed finds it absent (accelerate's availability check
    included), so a model saved there does not load it; where DeepSpeed is loaded, nothing changes."""
    with _hidden("deepspeed"):
        yield
