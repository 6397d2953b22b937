"""Processes that load models import transformers without scikit-learn (engines/lean_imports.py),
and scikit-learn still imports for whoever wants it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_trainer_process_loads_model_code_without_sklearn_and_sklearn_still_imports():
    got = _run("import sys, json\n"
               "import engines.train.worker\n"
               "from transformers import PreTrainedModel\n"
               "import transformers.generation.candidate_generator as cg\n"
               "before = 'sklearn' in sys.modules\n"
               "from sklearn.metrics import roc_curve\n"
               "print(json.dumps({'before': before, 'roc': [float(x) for x in roc_curve([0, 1], [0.2, 0.8])[1]]}))")
    assert got["before"] is False  # the model code loaded, scikit-learn did not
    assert got["roc"] == [0.0, 1.0, 1.0]  # a user's own `import sklearn` works as ever


def test_a_rollout_engine_process_loads_vllm_without_sklearn():
    got = _run("import sys, json\n"
               "from engines.rollout.actors import prepare_engine_process\n"
               "prepare_engine_process(1, None)\n"
               "from vllm import LLM\n"
               "import transformers.generation.candidate_generator\n"
               "print(json.dumps({'sklearn': 'sklearn' in sys.modules}))")
    assert got == {"sklearn": False}


def test_called_too_late_it_says_so_and_changes_nothing():
    got = _run("import sys, json\n"
               "import transformers.generation.candidate_generator as cg\n"
               "from engines.lean_imports import skip_sklearn_in_transformers\n"
               "print(json.dumps({'skipped': skip_sklearn_in_transformers(), 'sklearn': 'sklearn' in sys.modules,\n"
               "                  'check': cg.is_sklearn_available()}))")
    assert got == {"skipped": False, "sklearn": True, "check": True}


def test_a_trainer_rank_loads_deepspeed_without_mlflow_and_mlflow_still_imports():
    """What TrainWorker.setup does first: DeepSpeed loaded, its autotuner without MLflow, and MLflow
    importable right after for whoever wants it."""
    got = _run("import sys, json\n"
               "import engines.train.worker as worker\n"
               "ds = worker.import_deepspeed()\n"
               "from deepspeed.autotuning import autotuner\n"
               "before = 'mlflow' in sys.modules\n"
               "import mlflow\n"
               "print(json.dumps({'before': before, 'autotuner_mlflow': autotuner.has_mlflow,\n"
               "                  'same': ds is sys.modules['deepspeed'], 'mlflow': hasattr(mlflow, 'log_metric')}))")
    assert got == {"before": False, "autotuner_mlflow": False, "same": True, "mlflow": True}


def test_with_mlflow_already_loaded_deepspeed_loads_as_ever():
    got = _run("import sys, json\n"
               "import mlflow\n"
               "from engines.lean_imports import import_deepspeed\n"
               "import_deepspeed()\n"
               "from deepspeed.autotuning import autotuner\n"
               "print(json.dumps({'autotuner_mlflow': autotuner.has_mlflow,\n"
               "                  'mlflow': sys.modules['mlflow'] is mlflow}))")
    assert got == {"autotuner_mlflow": True, "mlflow": True}
