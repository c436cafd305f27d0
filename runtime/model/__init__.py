"""Running a model of the bundle: executors, sessions, batches, attention, costs."""
