"""Records on the storage root: runs and model versions (the registry), metric
history, run administration, report pages."""
