"""The worker process: one per device. Engines, the dynamic batcher and the receive/batch/launch/complete loop."""
