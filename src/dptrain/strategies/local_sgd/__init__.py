"""Strategy local_sgd: options.py (torch-free: its spec and options), strategy.py (its Strategy class)."""
