"""What more than one service imports: sampling parameters, the iteration plan, errors,
config parsing, the tokenizer and chat template, model sources.

Nothing here imports torch at module level (the scheduler core must stay torch-free)."""
