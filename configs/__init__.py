"""The default configuration, shipped in the package as ``default.toml`` (broker.common.config reads it)."""
