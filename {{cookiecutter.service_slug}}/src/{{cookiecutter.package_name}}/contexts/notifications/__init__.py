"""Example consumer context: records a notification for each order event it receives."""
