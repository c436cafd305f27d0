"""Structured output: grammars (JSON schema, JSON mode) that constrain the main model."""
