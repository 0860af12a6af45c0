"""Run-time autotuning of the engine's parameters (unit size, in-place threshold, channels, cycle time,
all-reduce algorithm): a bandit meta-solver over search techniques, fed with measured step times."""
