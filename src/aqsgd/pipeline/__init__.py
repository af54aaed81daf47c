"""Pipeline parallelism: model partitioning into stages, schedules, and a local reference executor."""
