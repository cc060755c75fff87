"""Data-parallel gradient averaging inside a stage group, compressed with error feedback."""
