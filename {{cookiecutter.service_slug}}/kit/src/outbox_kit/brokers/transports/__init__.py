"""One module per broker: topology, publish, and the transport's retry and dead-letter steps."""
