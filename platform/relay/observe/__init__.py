"""What people see of a run: the console, tracking (TensorBoard, MLflow), worker
logs, and the hang doctor."""
