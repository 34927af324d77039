"""The ways in besides the runner: radix generate, evaluation loops, data parallel."""
