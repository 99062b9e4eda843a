"""Plans: the op table, the cost and migration models, probes, the tuner and its plan files."""
