"""Model parallelism inside one forward: sequence (Ulysses), tensor, vocabulary and expert parallel pieces
(each module on its own; this package imports none of them)."""
