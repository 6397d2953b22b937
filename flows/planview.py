"""The plan as a table: each stage, its kind, inputs and key, and whether it is Cached or will run, and why;
printed by the CLI, and kept on the flow run (its Artifacts tab) for whoever opens it in the Prefect UI."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from alignflow.config import cache_relevant
from alignflow.redact import redact
from alignflow.errors import ConfigError
from alignflow.store.storage import Storage, StorageError
from tasks.context import RunContext
from tasks.plan import Plan, PlannedStage


def format_plan(plan: Plan, states: dict[str, StageState], storage_root: str) -> str:
    rows = [("stage", "kind", "inputs", "key", "state")]
    for s in plan.stages.values():
        inputs = ", ".join(name if name == src else f"{name}={src}" for name, src in s.inputs.items()) or "-"
        st = states[s.name]
        rows.append((s.name, s.kind, inputs, s.key, "Cached" if st.cached else f"will run: {st.why}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"plan ({len(plan.stages)} stages; storage {storage_root}):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines += [f"  skipped: {name} ({why})" for name, why in plan.skipped.items()]
    return "\n".join(lines)


def publish_plan(plan: Plan, ctx: RunContext) -> None:
    """The plan, as it stands when the flow run starts, as the flow run's markdown artifact `plan`."""
    from prefect.artifacts import create_markdown_artifact

    storage = ctx.storage()
    text = format_plan(plan, plan_states(plan, storage), storage.uri())
    create_markdown_artifact(markdown=f"```\n{text}\n```", key="plan",
                             description="each stage, its key, and Cached or why it runs")


# ---- what would run, and why --------------------------------------------------------


class StageState(BaseModel):
    cached: bool
    why: str  # for a stage that will run


STORAGE_CLIENTS = frozenset({"botocore", "aiobotocore", "s3fs", "fsspec", "gcsfs", "adlfs"})


def plan_states(plan: Plan, storage: Storage) -> dict[str, StageState]:
    """For every stage: committed already, with every file of its manifest still stored (Cached), or why it runs:
    what differs from its last commit, or the files lost since (a bucket's lifecycle rule, a cleanup: the flow
    runs such a stage again, stage_tasks.lost_artifact). A storage root that cannot be read (an endpoint down,
    credentials refused) is a ConfigError naming it: the plan reads it before preflight's own check would."""
    states = {}
    try:
        for stage in plan.stages.values():
            uri = storage.stage_uri(stage.name, stage.key)
            if storage.is_committed(uri):
                lost = storage.unstored(uri)  # one listing of the stage's prefix
                why = f"files lost since its commit: {', '.join(lost[:3])}{' ...' * (len(lost) > 3)}" if lost else ""
                states[stage.name] = StageState(cached=not lost, why=why)
            else:
                states[stage.name] = StageState(cached=False, why=_why(stage, storage.latest_commit(stage.name)))
    except StorageError:
        raise
    except Exception as err:  # noqa: BLE001  (fsspec's backends raise their own: botocore's, OSError, ...)
        if not (isinstance(err, OSError) or type(err).__module__.split(".")[0] in STORAGE_CLIENTS):
            raise  # not the root's to answer for (a bad manifest, a bug): as it is
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"infra.storage.root {storage.uri()} cannot be read ({type(err).__name__}: {detail}): "
                          "check the root, infra.storage.endpoint_url and the credentials the environment gives "
                          "its client") from None
    return states


def _why(stage: PlannedStage, last: dict[str, Any] | None) -> str:
    if last is None:
        return "never committed"
    if "input_keys" not in last:
        return "last commit predates plan records"
    reasons = []
    if last.get("code_version") != stage.code_version:
        reasons.append(f"code changed (version {last.get('code_version')} -> {stage.code_version})")
    # Both sides redacted: this text is printed and kept on the flow run, and a manifest from before
    # alignflow/redact.py may hold a credential-bearing URL. A credential is still in the key.
    config = cache_relevant(stage.config)
    shown = redact(config)
    changed = _diff(redact(last.get("config", {})), shown)
    if changed:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:3])
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        reasons.append(f"config changed: {shown}{more}")
    inputs = sorted(n for n in {*last["input_keys"], *stage.input_keys}
                    if last["input_keys"].get(n) != stage.input_keys.get(n))
    if inputs:
        reasons.append(f"input changed: {', '.join(inputs)}")
    if not reasons and shown != config:
        return "not committed under this key (a credential in the config may have changed: none is recorded)"
    return "; ".join(reasons) or "not committed under this key"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def _diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted({*a, *b}) if a.get(k) != b.get(k)}
