"""What every shmbroker process shares: the wire format, the ring, the runtime directory, the config and the
small policies (spin, liveness, process naming) that the broker, workers, front-ends and clients all use."""
