"""Jobs: spec, state machine, planner (drives consensus over the DHT), runner."""
