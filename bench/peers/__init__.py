"""Other servers on the broker's own engine, and one load generator for all of them (``python -m
shmbroker.bench.peers.run``; bench/README.md, "Peers")."""
