"""Publishing claimed runs to the broker: the dispatcher, the fast path and its message parts, the
Redis writer, building messages ahead, run now and the ad-hoc publishing of application code."""
