"""Datasets with a stable integer id per training example, deterministic shuffling and sharding."""
