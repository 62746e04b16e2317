"""relay's one typed config: runs (run.py), sweeps (sweep.py), files and `--set` overrides
(overrides.py), tracking URIs (uris.py), what they share (base.py); the reference page is
generated from their field descriptions (reference.py). Every name callers use is here."""

from __future__ import annotations

from relay.config.base import NAME_PATTERN, ConfigError, Section, error_lines, name_field
from relay.config.overrides import apply_overrides, flatten, parse_override, read_yaml, set_dotted
from relay.config.run import (
    CheckpointConfig,
    DataConfig,
    DoctorConfig,
    FailureConfig,
    FileFormat,
    MlflowConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    ScheduleConfig,
    TrackingConfig,
    from_dict,
    load,
    resolve_storage,
)
from relay.config.sweep import (
    PBT_FIXED_FIELDS,
    AshaConfig,
    Distribution,
    PbtConfig,
    SearchAlgorithm,
    SearchDimension,
    SweepConfig,
    load_sweep,
    sweep_from_dict,
    trial_config,
)
from relay.config.uris import TRACKING_SCHEMES, redacted_uri, uri_credentials

__all__ = [
    "NAME_PATTERN",
    "PBT_FIXED_FIELDS",
    "TRACKING_SCHEMES",
    "AshaConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "Distribution",
    "DoctorConfig",
    "FailureConfig",
    "FileFormat",
    "MlflowConfig",
    "OptimConfig",
    "ParallelConfig",
    "PbtConfig",
    "RunConfig",
    "ScalingConfig",
    "ScheduleConfig",
    "SearchAlgorithm",
    "SearchDimension",
    "Section",
    "SweepConfig",
    "TrackingConfig",
    "apply_overrides",
    "error_lines",
    "flatten",
    "from_dict",
    "load",
    "load_sweep",
    "name_field",
    "parse_override",
    "read_yaml",
    "redacted_uri",
    "resolve_storage",
    "set_dotted",
    "sweep_from_dict",
    "trial_config",
    "uri_credentials",
]
