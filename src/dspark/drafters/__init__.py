"""Drafters: the DSpark/DFlash drafter (backbone + sequential head + confidence head) and shared layers."""

from dspark.drafters.backbone import DSparkBackbone, create_block_mask  # noqa: F401
from dspark.drafters.dspark import DSparkDrafter, DSparkOutput  # noqa: F401
from dspark.drafters.heads import SEQUENTIAL_HEADS, ConfidenceHead, SequentialHead, build_sequential_head  # noqa: F401
from dspark.drafters.layers import DraftLayerSpec  # noqa: F401
from dspark.drafters.eagle3 import Eagle3Drafter, Eagle3Output, create_ttt_mask  # noqa: F401
