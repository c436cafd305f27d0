"""The KV arena: paged, head-tiled blocks shared by main and draft models."""
