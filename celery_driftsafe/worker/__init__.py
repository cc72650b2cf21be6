"""A run in the worker: one delivery's execution under the ledger and its locks, the request class
and signals of a worker's main process, and the receivers of plain tasks."""
