"""shmbroker's control plane: config, sessions and rings, worker supervision, health; and the shared wire format."""

__version__ = "0.1.0"
