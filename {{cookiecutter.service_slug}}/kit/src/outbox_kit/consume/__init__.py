"""Consuming: the inbox pipeline a received message runs through, and the bus that feeds it."""
