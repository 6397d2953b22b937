"""A shorter start for every process that loads a model: transformers without scikit-learn, and a
trainer's DeepSpeed without MLflow.

transformers imports scikit-learn, and with it scipy and pandas, whenever the
package is installed. It uses it for one feature alignflow never calls: the
dynamic confidence threshold of assisted generation
(transformers/generation/candidate_generator.py). It is installed because
MLflow requires it. On 2 cores it is 0.66 s of a trainer's 4.54 s of imports
and 0.33 s of a vLLM engine's 7.30 s (`bench/imports.py`), and a first run
starts over a dozen such processes: trainers, rollout engines, scorers, the
stages' task workers (136 s instead of about 150 s, side by side).

`skip_sklearn_in_transformers()`, called before transformers loads its
model code, makes transformers' availability check say no. Nothing else
changes: `import sklearn` still works for a user's reward function or
checker (tests/engines/test_engines_lean_imports.py).

DeepSpeed's autotuner imports MLflow, when it is installed, as DeepSpeed itself
loads (deepspeed/autotuning/autotuner.py), to log autotuning experiments;
alignflow never autotunes, and its trainers log nothing to MLflow (the stage's
task does). MLflow is installed because alignflow tracks runs with it. That
import was about half of `import deepspeed` in each trainer rank: 4 s of 8 s
of CPU on a 2-core AMD EPYC (`bench/imports.py`). `import_deepspeed()` loads
DeepSpeed with MLflow hidden; `import mlflow` works again as soon as it returns.
"""

from __future__ import annotations

import sys

_TOO_LATE = "transformers.generation.candidate_generator"


def _absent() -> bool:
    return False


def skip_sklearn_in_transformers() -> bool:
    """Whether transformers' model code will load without scikit-learn: False where that code was
    already imported (this process loaded it before calling here), or the check has another name
    in this transformers version."""
    if _TOO_LATE in sys.modules:
        return "sklearn" not in sys.modules
    import transformers.utils as utils
    from transformers.utils import import_utils

    if not hasattr(utils, "is_sklearn_available"):
        return False
    utils.is_sklearn_available = import_utils.is_sklearn_available = _absent
    return True


def import_deepspeed():
    """`deepspeed`, loaded without its autotuner's MLflow import where this process has not imported
    MLflow already (then DeepSpeed finds it loaded and it costs nothing). Called where a trainer rank
    first needs DeepSpeed, in an actor that runs one call at a time: no other thread imports meanwhile."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: DeepSpeed's autotuner goes without
        try:
            import deepspeed
        finally:
            if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
    import deepspeed

    return deepspeed
