"""Model parallelism inside one forward: sequence (Ulysses), tensor and expert parallel layers."""
