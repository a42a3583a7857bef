"""Applications built on the library: command line, demo, benchmarks, plots."""
