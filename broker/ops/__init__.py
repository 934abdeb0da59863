"""Operations around the serving loop: systemd notification, probes, the health and metrics HTTP server, the
GPU inventory and the live status view."""
