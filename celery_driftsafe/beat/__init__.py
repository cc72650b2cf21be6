"""A beat's life around the claim: its node (start, heartbeat, stop), the wake-ups, the recovery
pass and the garbage collector's settings."""
