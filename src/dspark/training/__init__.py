"""Training: the LightningModule that orchestrates drafter, loss and metrics; optimiser and schedule."""
