"""Benchmarks: the broker against a raw ZeroMQ echo and the in-process engine limit, in one run."""
