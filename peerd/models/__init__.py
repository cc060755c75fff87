"""Model definitions that know nothing about parallelism."""
