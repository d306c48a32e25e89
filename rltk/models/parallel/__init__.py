"""Model-parallel pieces: sequence, tensor, vocabulary and expert parallelism (each module on its own)."""
