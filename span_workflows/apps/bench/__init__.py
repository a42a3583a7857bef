"""``span-workflows bench``: the benchmarks, their data sets, tables, plots and provenance."""
