"""dsrun: generate, bench and serve from the command line."""
