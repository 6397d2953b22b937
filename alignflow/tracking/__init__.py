"""MLflow: one parent run per pipeline run and one child run per stage (runs.py, the only module that imports mlflow), and what alignflow hands it (params.py)."""
