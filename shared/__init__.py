"""What more than one service imports: sampling parameters, the iteration plan, errors,
config parsing, the tokenizer and chat template, model sources, the Redis protocol, and the
runtime every service shares (`lifecycle.py`, `redis_retry.py`, `engine_layout.py`,
`service_args.py`).

Nothing here imports torch at module level (the scheduler core must stay torch-free), and
importing it changes nothing in the process (`openmp.py` is called by the entry points).
"""
