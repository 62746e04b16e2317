"""Training: the driver of a run, the loop every worker runs, the epochs in plain
torch, the data path, and what a run measures (efficiency, memory plan)."""
