"""Pipeline parallelism: stage partitioning, micro-batch schedules, stage workers, activation streams."""
