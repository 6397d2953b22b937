"""The plan as a table: each stage, its kind, inputs and key, and whether it is Cached or will run, and why;
printed by the CLI, and kept on the flow run (its Artifacts tab) for whoever opens it in the Prefect UI."""

from __future__ import annotations

from tasks.context import RunContext
from tasks.plan import Plan, StageState, plan_states


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
