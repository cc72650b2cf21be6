"""Monitoring: the Prometheus metrics and their hooks (a sink: it imports nothing of the run's
path), their HTTP server, the database's view of the cluster and the metrics view."""
