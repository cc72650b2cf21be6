"""The pure core: instants, schedules and their slots, bounds, jitter, misfire plans, the stored
names, the rules of what a task may store and the message headers' names. No Django, no I/O, no
clock: time is a parameter."""
