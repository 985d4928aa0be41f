"""Run stages: prepare (regenerate data) → train (drafter) → eval (lossless decoding) → report."""
