"""Processes that load models import transformers without scikit-learn and scipy, vLLM without scipy
and OpenCV, and DeepSpeed without MLflow (engines/lean_imports.py); each still imports for whoever
wants it, and what vLLM went without is a placeholder that says so where it would be called."""

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


def test_a_trainer_process_loads_model_code_without_sklearn_or_scipy_and_both_still_import():
    got = _run("import sys, json\n"
               "import engines.train.worker\n"
               "from transformers import PreTrainedModel\n"
               "import transformers.generation.candidate_generator as cg\n"
               "import transformers.loss.loss_for_object_detection as od\n"
               "before = sorted(m for m in ('sklearn', 'scipy') if m in sys.modules)\n"
               "from sklearn.metrics import roc_curve\n"
               "from scipy.optimize import linear_sum_assignment\n"
               "print(json.dumps({'before': before, 'roc': [float(x) for x in roc_curve([0, 1], [0.2, 0.8])[1]],\n"
               "                  'lsa': [int(x) for x in linear_sum_assignment([[2, 1], [1, 2]])[1]],\n"
               "                  'od_lsa': hasattr(od, 'linear_sum_assignment')}))")
    assert got["before"] == []  # the model code loaded, scikit-learn and scipy did not
    assert got["od_lsa"] is False  # the detection loss went without its optimizer
    assert got["roc"] == [0.0, 1.0, 1.0]  # a user's own `import sklearn` works as ever
    assert got["lsa"] == [1, 0]  # and `import scipy`


def test_a_rollout_engine_process_loads_vllm_without_sklearn_scipy_or_opencv():
    """As RolloutActor loads it (EngineHost: the same without the device check first). vLLM's audio
    resampling and video reading, the two places that wanted scipy and OpenCV, hold vLLM's placeholders;
    scipy imports right after for whoever wants it."""
    got = _run("import sys, json\n"
               "from engines.rollout.engine_build import prepare_engine_process\n"
               "from engines.lean_imports import import_vllm\n"
               "prepare_engine_process(1, None)\n"
               "from vllm.platforms import current_platform\n"  # build_engine's device check comes first
               "vllm = import_vllm()\n"
               "import transformers.generation.candidate_generator\n"
               "from vllm.multimodal import audio, video\n"
               "from vllm.utils.import_utils import PlaceholderModule\n"
               "loaded = sorted(m for m in ('sklearn', 'scipy', 'cv2') if m in sys.modules)\n"
               "import scipy.signal\n"
               "print(json.dumps({'loaded': loaded, 'LLM': hasattr(vllm, 'LLM'),\n"
               "                  'video_cv2': isinstance(video.cv2, PlaceholderModule),\n"
               "                  'audio_scipy': type(audio.scipy_signal).__name__,\n"
               "                  'scipy_after': hasattr(scipy.signal, 'resample_poly')}))")
    assert got["loaded"] == [] and got["LLM"] is True
    assert got["video_cv2"] is True and got["audio_scipy"] != "module"
    assert got["scipy_after"] is True


def test_called_too_late_it_says_so_and_changes_nothing():
    got = _run("import sys, json\n"
               "import transformers.generation.candidate_generator as cg\n"
               "from engines.lean_imports import lean_transformers\n"
               "print(json.dumps({'skipped': lean_transformers(), 'sklearn': 'sklearn' in sys.modules,\n"
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


def test_a_process_that_never_trained_saves_a_model_without_loading_deepspeed(tmp_path):
    """The base-model stage's save (transformers' unwrap asks accelerate, which imported all of DeepSpeed to
    look for a DeepSpeedEngine): DeepSpeed stays unloaded, the model loads back as saved, and DeepSpeed imports
    right after for whoever wants it."""
    got = _run("import sys, json, torch\n"
               "from transformers import AutoModelForCausalLM\n"
               "from engines.models import build_tiny_model\n"
               "from alignflow.config import TinyModelConfig\n"
               "cfg = TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64)\n"
               f"path = build_tiny_model(cfg, seed=0, out_dir={str(tmp_path / 'model')!r})\n"
               "loaded = 'deepspeed' in sys.modules\n"
               "model = AutoModelForCausalLM.from_pretrained(path)\n"
               "import deepspeed\n"
               "print(json.dumps({'loaded': loaded, 'layers': model.config.num_hidden_layers,\n"
               "                  'finite': all(torch.isfinite(p).all().item() for p in model.parameters()),\n"
               "                  'engine': hasattr(deepspeed, 'DeepSpeedEngine')}))")
    assert got == {"loaded": False, "layers": 1, "finite": True, "engine": True}
