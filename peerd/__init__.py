"""peerd: train foundation models on volunteer GPUs over slow, heterogeneous networks."""

__version__ = "0.1.0"
