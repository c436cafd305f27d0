"""Drafters: what proposes draft tokens, each owning its per-sequence state."""
