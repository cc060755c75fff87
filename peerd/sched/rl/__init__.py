"""The RL post-training scheduler (HetRL ideas): where GRPO/PPO tasks run on heterogeneous devices.

Pure and deterministic, no I/O beyond loading a scenario file: ``workload`` and ``workflow``
describe the job, ``cost`` / ``memory`` / ``group`` / ``evaluate`` predict a plan's iteration
time, ``hybrid`` (successive halving + GA) and ``exact`` (MILP, HiGHS) search, ``brute`` checks
tiny instances, ``baselines`` are verl-like and StreamRL-like plans, ``planner`` is the front door.
"""
