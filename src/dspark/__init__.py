"""DSpark Lab: train, evaluate and ablate speculative-decoding drafters (DSpark, DFlash, EAGLE-3)."""

__version__ = "0.1.0"
