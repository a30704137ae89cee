"""Tools around the compiler: explain, plots, pruning, data sets, and the timing harness and model zoo that
benchmarks/, examples/ and the model tests share. Nothing below scorch_backend's tools/ imports from here."""
