"""What a task declares: its uniqueness options, parsed once, and its duplicate policy."""
