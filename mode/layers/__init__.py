"""Layers: attention and the blocks that share one interface, ``block(x, positions) -> x``."""
