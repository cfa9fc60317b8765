"""Model definitions assembled from engine.layers, with the checkpoint names their weights load from.

May import: engine.distributed and engine.layers.
"""
