"""The plan as a table: each stage, its kind, inputs and key, and whether it is Cached or will run, and why."""

from __future__ import annotations

from tasks.plan import Plan, StageState


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
