"""How a run's data reaches its workers: the choice and the object-store path (ingest), the Ray
Data path (raydata), and data from files (sources)."""
