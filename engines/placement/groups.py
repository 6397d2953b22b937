"""Reserving a placement group: wait while other stages hold what it needs, fail when no node can.

A pipeline runs every stage whose inputs are ready at once: on a machine with
one GPU, a round's placement group waits while the evaluations that became
ready with it hold the GPU, then takes it. That wait is the plan working, not
an error. A group the cluster could never hold (a bundle larger than every
node, or a STRICT_PACK group larger than any one node) is an error: it fails
after `timeout_s`, the time an autoscaler gets to add a node.

    placement_fits(bundles, strategy, nodes)   can these nodes ever hold the group?
    wait_placement_group(pg, what, strategy)   block until Ray reserves it
    reserve_together(options, count, what)     `count` actors that start all together or not at all
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from alignflow.errors import InsufficientResourcesError

log = logging.getLogger("alignflow")
TIMEOUT_S = 300.0  # for a group no node can hold: an autoscaler's time to add one
POLL_S = 30.0
SAY_EVERY_S = 300.0  # while a group waits for other stages' resources


def _holds(node: dict[str, float], need: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in need.items() if v > 0)


def _total(bundles: Sequence[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def placement_fits(bundles: Sequence[dict[str, float]], strategy: str, nodes: Sequence[dict[str, float]]) -> bool:
    """Whether nodes with these total resources can hold the group once nothing else holds them.
    STRICT_PACK: one node holds every bundle. PACK and SPREAD: every bundle fits some node and the
    nodes together hold them all (a bundle never splits across nodes)."""
    if strategy == "STRICT_PACK":
        return any(_holds(n, _total(bundles)) for n in nodes)
    cluster = _total(nodes)
    return all(any(_holds(n, b) for n in nodes) for b in bundles) and _holds(cluster, _total(bundles))


def wait_placement_group(pg, what: str, strategy: str, *, timeout_s: float = TIMEOUT_S, poll_s: float = POLL_S,
                         say_every_s: float = SAY_EVERY_S) -> None:
    """Block until Ray reserves `pg` (made with `strategy`). While the alive nodes could hold it, wait
    as long as it takes, saying every `say_every_s` what it waits for; once they could not for
    `timeout_s`, remove it and raise InsufficientResourcesError naming the bundles and the nodes."""
    import ray

    ready_ref, start, said = pg.ready(), time.monotonic(), -say_every_s  # the first poll says
    while not ray.wait([ready_ref], timeout=poll_s)[0]:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        waited = time.monotonic() - start
        if not placement_fits(pg.bundle_specs, strategy, nodes):
            if waited >= timeout_s:
                ray.util.remove_placement_group(pg)
                raise InsufficientResourcesError(
                    f"{what}: no node of this Ray cluster can hold {pg.bundle_specs} ({strategy}); waited "
                    f"{waited:.0f} s for one. The nodes have {nodes}")
        elif waited - said >= say_every_s:
            said = waited
            log.warning("%s: waiting %.0f s for %s: the cluster has it, other stages hold it now (free: %s)",
                        what, waited, pg.bundle_specs, ray.available_resources())


def reserve_together(options: dict, count: int, what: str) -> tuple[object, list[dict]]:
    """A placement group (PACK) of `count` bundles, each holding what one actor of `options` (Ray actor
    options: num_cpus, num_gpus, resources) asks for, reserved as `wait_placement_group` says; the group
    and each actor's options, on its bundle. None and `options` as they are for one actor (it starts
    whole or not at all) or for actors that ask for nothing to reserve.

    For the ranks of one process group: placed one by one, the first could start and wait in the
    group's rendezvous holding its GPU while another stage holds what the rest need, and two such
    stages would each wait for the other."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {k: float(v) for k, v in {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0),
                                       **(options.get("resources") or {})}.items() if v}
    if not bundle or count == 1:
        return None, [dict(options)] * count
    import ray

    pg = ray.util.placement_group([bundle] * count, strategy="PACK")
    try:
        wait_placement_group(pg, what, "PACK")
    except BaseException:  # interrupted or cancelled while waiting: a pending group would take the resources later
        ray.util.remove_placement_group(pg)
        raise
    own = {k: v for k, v in options.items() if k != "resources"}  # the bundle holds them
    return pg, [{**own, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
                for i in range(count)]
