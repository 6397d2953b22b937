"""One module per kind of stage: what a stage computes from its inputs (tasks/registry.py names each kind's
function here; tasks/runner.py runs it as a Prefect task)."""
