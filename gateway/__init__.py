"""The OpenAI-compatible HTTP front door (aiohttp).

Owns text: tokenizing prompts, chat templates, incremental detokenizing and stop strings.
It validates requests, enqueues them on the Redis `requests` stream, turns the token events
that come back on its pub/sub channel into JSON or SSE, and aborts requests whose client left.

    config.py         GatewayConfig, the frozen start-up settings
    openai_schema.py  request validation and OpenAI response shapes
    prompts.py        prompt token ids and SamplingParams from a validated request
    streams.py        the one pub/sub listener per process and per-request event streams
    upstream.py       submitting and aborting requests on Redis
    text_output.py    detokenizing and stop strings for one request
    generation.py     one request in flight: events in, text deltas out, metrics
    responses.py      deltas -> one JSON body or SSE chunks
    handlers.py       the HTTP endpoints
    state.py          what handlers share (tokenizer, Redis, router), kept on the app
    metrics.py        Prometheus metrics (gateway-measured and read from the scheduler)
    app.py            create_app / run_gateway
    cli.py            `pacer gateway`
"""
