"""What a run is, resolved once by the driver and read the same by every process (run_spec/plans.py)."""

from .plans import (
    INT8_WEIGHT_BITS,
    SPEC_DEST,
    WEIGHT_GRID,
    ClusterPlan,
    DumpPlan,
    RewardPlan,
    RolloutPlan,
    RunSpec,
    StalenessPlan,
    SyncPlan,
    run_spec,
    spec_flags,
)

__all__ = ["INT8_WEIGHT_BITS", "SPEC_DEST", "WEIGHT_GRID", "ClusterPlan", "DumpPlan", "RewardPlan", "RolloutPlan",
           "RunSpec", "StalenessPlan", "SyncPlan", "run_spec", "spec_flags"]
