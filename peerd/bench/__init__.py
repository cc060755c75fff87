"""Benchmarks behind ``peerd bench``: each module exposes a click ``command`` printing JSON."""
