"""The broker's serving loop: the session table, the rings it hands out, worker supervision and health."""
