"""Pure loss functions of drafter outputs (METHOD §3, §4)."""
from dspark.losses.dspark import DSparkLoss, compute_dspark_loss, position_weights  # noqa: F401
from dspark.losses.eagle3 import Eagle3Loss, compute_eagle3_acceptance_proxy, compute_eagle3_loss  # noqa: F401
