"""Planning consensus, sans-IO: the state machine, its messages and wire form, tallies, epochs, config, actions."""
