"""Small shared helpers below every layer: the rank-0 logger, signals and preemption, ports, child processes,
memory, paths and shared file systems. The run directory's modules live in run/."""
