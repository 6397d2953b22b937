"""Every random seed derives from the pipeline's one `seed`.

    stage seed    = derive_seed(pipeline seed, stage name)      e.g. "sft", "round_2"
    purpose seed  = derive_seed(stage seed, purpose)            e.g. "actor", "rollout/0"

A derived seed is the first 31 bits of sha256("{parent}/{name}"): stable
across Python versions and machines, different for every stage and purpose,
and a pure function of the config, so the same config and seed give the
same data order, initialisations and samples. All policy evaluations share
the seed of "evaluation", so policies are compared on the same draws.
"""

from __future__ import annotations

import hashlib


def derive_seed(parent: int, name: str) -> int:
    digest = hashlib.sha256(f"{parent}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
