"""The producer: `fan_in_group` builds a plan, writes it to the store and publishes its children; the handle reads
it back. Eager mode (`task_always_eager`) runs the whole fan-in in the producer's process."""
