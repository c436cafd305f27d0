"""The tokenizer gate: bundle tokenizer files, draft/main alignment checks."""
