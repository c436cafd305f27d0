"""The .dsmodel format: reader, specs, memory plan, config, token map, tokenizer."""
