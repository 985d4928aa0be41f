"""Pure loss functions of drafter outputs (METHOD §3, §4)."""

from dspark.losses.dspark import (  # noqa: F401
    POSITION_WEIGHTS,
    DSparkLoss,
    compute_dspark_loss,
    dpace_position_weights,
    position_weights,
)
from dspark.losses.eagle3 import Eagle3Loss, compute_eagle3_acceptance_proxy, compute_eagle3_loss  # noqa: F401
from dspark.losses.dpard import compute_dpard_loss  # noqa: F401
from dspark.registry import Registry

# `loss.kind`: the DSpark / DFlash objective; each takes the drafter output and returns a DSparkLoss.
BLOCK_OBJECTIVES: Registry = Registry("loss.kind")
BLOCK_OBJECTIVES.add("paper", compute_dspark_loss)
BLOCK_OBJECTIVES.add("dpard", compute_dpard_loss)
