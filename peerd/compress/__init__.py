"""Quantizers, the AC-SGD activation-delta codec and gradient compression with error feedback (pure torch)."""
