"""A shorter start for every process that loads a model: transformers without scikit-learn.

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
