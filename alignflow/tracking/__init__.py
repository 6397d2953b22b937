"""MLflow: one parent run per pipeline run and one child run per stage (runs.py and stage_run.py, the only modules
that import mlflow), and what alignflow hands it (params.py)."""
