"""The run ledger: the worker's conditional writes, lost runs, and retention (pruning finished
runs)."""
