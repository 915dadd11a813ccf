"""Operating the relay: what an operator can see and do, and retention."""
