"""A judge's verdict as a score: a regex's first group looked up in the verdict words' scores (or read as a
number), or a number under a JSON object's key. Pure, so the config can check the verdicts the pipeline's
judge is trained on (alignflow/config/pipeline.py) with the parser the rounds use (engines/rl/judge.py)."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alignflow.config.round.judge import JudgeRewardConfig


def parse_verdict(text: str, cfg: JudgeRewardConfig) -> float | None:
    """A verdict's score, or None where it does not parse (no match, an unknown word, no finite number)."""
    if cfg.parse == "json":
        value = _json_score(text, cfg.json_key)
    else:
        match = re.search(cfg.pattern, text, flags=re.IGNORECASE)
        if not match or match.group(1) is None:
            return None
        word = match.group(1).strip()
        scores = {k.lower(): v for k, v in cfg.scores.items()}
        try:
            value = scores[word.lower()] if word.lower() in scores else float(word)
        except ValueError:
            return None
    return value if value is not None and math.isfinite(value) else None


def _json_score(text: str, key: str) -> float | None:
    """`key` of the first JSON object in `text` that has it at its top level, a number (not a bool, whose
    float would be a score of 1 or 0): objects nested in another are its values, not verdicts."""
    decoder, at = json.JSONDecoder(), text.find("{")
    while at != -1:
        try:
            obj, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            at = text.find("{", at + 1)
            continue
        value = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                return None
        at = text.find("{", end)
    return None
