"""Usage: the snapshots the tick takes, what changed since, the proven quiet bounds, several workers' maps as one."""
