"""Benchmarks of the outer step (reached from the command line): variants, ahead-of-time compiles and memory,
step time, the largest model that fits, and reports."""
