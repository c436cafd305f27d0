"""Graph rewrites of the compiler's stages, each `pass(graph) -> count`."""
