"""Data: prompt sets (registry, loaders, offline generator), response regeneration, training blocks, DataModule."""
