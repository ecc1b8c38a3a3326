"""Real processes for the tests and the benchmarks: a node agent, a Jupyter server, a notebook."""
