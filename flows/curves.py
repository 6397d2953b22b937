"""Learning curves of a pipeline run, drawn from its stages' MLflow metric histories.

`draw_curves` writes up to three PNGs: `loss.png` (training loss, one panel
per training stage), `rounds.png` (reward, KL and, when a round logs one,
accuracy per RL step, the rounds laid end to end on one step axis) and
`eval.png` (evaluation accuracy per policy). A figure whose metrics are
absent is not drawn. `publish_curves` logs them to the parent run (artifact
folder `curves/`) and copies them to `{storage root}/curves/{parent run id}/`;
it never raises: a failure is a warning, the pipeline goes on.

matplotlib is imported on first use, and only its object-oriented API with
the Agg canvas (no pyplot: no global figure state, no GUI backend).
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignflow.cluster import scratch_dir

if TYPE_CHECKING:
    from alignflow.store.storage import Storage
    from alignflow.tracking.runs import Tracker

log = logging.getLogger("alignflow")

CURVES_DIR = "curves"
LOSS = "train/loss"
REWARD, REWARD_STD, KL = "rl/reward/mean", "rl/reward/std", "rl/kl"
EVAL_ACCURACY = "eval/accuracy"
DPI = 100

Histories = Mapping[str, Mapping[str, list[tuple[int, float]]]]


def wanted(key: str) -> bool:
    """The metric keys the curves read (so only those histories are fetched)."""
    return key in (LOSS, REWARD, REWARD_STD, KL, EVAL_ACCURACY) or _is_round_accuracy(key)


def _is_round_accuracy(key: str) -> bool:
    return key.startswith("rl/") and key.endswith("accuracy")


def stage_order(name: str) -> tuple[int, int, str]:
    """base, sft, reward_model (and process_reward_model), round_1, round_2, ..., then the rest by name (an
    `eval_` prefix ignored)."""
    bare = name.removeprefix("eval_")
    fixed = {"base": 0, "base_model": 0, "sft": 1, "reward_model": 2, "process_reward_model": 2}
    if bare in fixed:
        return fixed[bare], 0, bare
    m = re.fullmatch(r"round_(\d+)", bare)
    return (3, int(m.group(1)), bare) if m else (4, 0, bare)


def _series(histories: Histories, stage: str, key: str | None) -> list[tuple[int, float]]:
    return list(histories.get(stage, {}).get(key, [])) if key else []


def _figure(n_panels: int, width: float = 4.6, height: float = 3.4) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_panels, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, n_panels, squeeze=False)[0])


def _loss_figure(histories: Histories) -> Any | None:
    stages = sorted((s for s in histories if _series(histories, s, LOSS)), key=stage_order)
    if not stages:
        return None
    fig, axes = _figure(len(stages))
    for ax, stage in zip(axes, stages):
        steps, values = zip(*_series(histories, stage, LOSS))
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3)
        ax.set_title(f"{stage}: training loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    fig.suptitle("Training loss per stage")
    return fig


def _rounds_figure(histories: Histories) -> Any | None:
    rounds = sorted((s for s in histories if _series(histories, s, REWARD) or _series(histories, s, KL)),
                    key=stage_order)
    if not rounds:
        return None
    accuracy = next((k for s in rounds for k in sorted(histories[s]) if _is_round_accuracy(k)), None)
    panels = [(key, title, label) for key, title, label in (
        (REWARD, "reward (mean per step)", "reward"),
        (KL, "KL to the reference (per sequence)", "KL"),
        (accuracy, f"accuracy ({accuracy})", "accuracy"),
    ) if any(_series(histories, s, key) for s in rounds)]
    # Rounds end to end: each round's steps shifted past the last step of the rounds before it.
    offsets, end = {}, 0
    for stage in rounds:
        offsets[stage] = end
        end += max((step for key, _, _ in panels for step, _ in _series(histories, stage, key)), default=0)
    fig, axes = _figure(len(panels))
    colors = [f"C{i % 10}" for i in range(len(rounds))]
    for ax, (key, title, label) in zip(axes, panels):
        for stage, color in zip(rounds, colors):
            points = _series(histories, stage, key)
            if not points:
                continue
            steps = [offsets[stage] + step for step, _ in points]
            values = [v for _, v in points]
            ax.plot(steps, values, color=color, label=stage, marker="o" if len(steps) <= 30 else None, markersize=3)
            std = dict(_series(histories, stage, REWARD_STD)) if key == REWARD else {}
            if std and all(step in std for step, _ in points):
                spread = [std[step] for step, _ in points]
                ax.fill_between(steps, [v - s for v, s in zip(values, spread)],
                                [v + s for v, s in zip(values, spread)], color=color, alpha=0.15, linewidth=0)
        for stage in rounds[1:]:
            ax.axvline(offsets[stage] + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("RL step (rounds end to end)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("RL rounds" + (" (band: reward ± std)" if any(_series(histories, s, REWARD_STD) for s in rounds)
                                else ""))
    return fig


def _eval_figure(histories: Histories) -> Any | None:
    stages = sorted((s for s in histories if s.startswith("eval_") and _series(histories, s, EVAL_ACCURACY)),
                    key=stage_order)
    if not stages:
        return None
    labels = [s.removeprefix("eval_") for s in stages]
    values = [_series(histories, s, EVAL_ACCURACY)[-1][1] for s in stages]
    fig, (ax,) = _figure(1, width=max(4.0, 1.1 * len(stages) + 1.5))
    bars = ax.bar(labels, values, color=[f"C{i % 10}" for i in range(len(stages))])
    ax.bar_label(bars, fmt="%.3f", fontsize="small")
    ax.set_ylim(0, max(1.0, max(values) * 1.1))
    ax.set_title("Evaluation accuracy per policy")
    ax.set_xlabel("policy")
    ax.set_ylabel("accuracy")
    ax.grid(axis="y", alpha=0.3)
    return fig


FIGURES = (("loss.png", _loss_figure), ("rounds.png", _rounds_figure), ("eval.png", _eval_figure))


def draw_curves(histories: Histories, out_dir: str | Path) -> list[Path]:
    """PNGs of `histories` (stage -> metric key -> [(step, value)]) in `out_dir`; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in FIGURES:
        fig = build(histories)
        if fig is not None:
            fig.savefig(out / name, format="png")
            written.append(out / name)
    return written


def publish_curves(tracker: Tracker, storage: Storage, parent_run_id: str,
                   stage_keys: Mapping[str, str] | None = None) -> str | None:
    """Draw the run's curves, log them to its parent run and copy them under the storage root.

    Returns the folder they were copied to, or None when there was nothing
    to draw or drawing failed (logged as a warning: never raises).
    """
    started = time.perf_counter()
    try:
        histories = tracker.metric_histories(parent_run_id, stage_keys=stage_keys, keep=wanted)
        with tempfile.TemporaryDirectory(prefix="alignflow-curves-", dir=scratch_dir()) as tmp:
            paths = draw_curves(histories, tmp)
            if not paths:
                log.info("learning curves: no training, round or evaluation metrics to draw")
                return None
            run, dest = tracker.run(parent_run_id), storage.uri(CURVES_DIR, parent_run_id)
            for path in paths:
                run.log_artifact(path, CURVES_DIR)
                storage.put_file(path, f"{dest}/{path.name}")
    except Exception as err:  # the curves are a report: the run's results stand without them
        log.warning("learning curves not saved (%s: %s)", type(err).__name__, err)
        return None
    log.info("learning curves (%s) at %s and in MLflow run %s under %s/, %.2fs",
             ", ".join(p.name for p in paths), dest, parent_run_id, CURVES_DIR, time.perf_counter() - started)
    return dest
