"""The decoding loop: scheduler, round plan, acceptance, engine and its loader."""
