"""Pure, deterministic scheduling: cost models, evolutionary allocation search, ordering, consensus."""
