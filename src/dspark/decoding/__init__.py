"""Lossless speculative decoding (METHOD §5): the one verifier (`verify`), the engine and truncation policies."""
