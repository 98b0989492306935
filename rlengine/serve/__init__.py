"""`rlengine serve`: an OpenAI-compatible HTTP server on one engine (needs the `serve` extra: fastapi, uvicorn).

    protocol.py     request bodies -> token-id prompts + SamplingParams; OpenAI's error shape
    engine_loop.py  the one thread that drives LLM.step for every request and streams tokens out
    streams.py      the HTTP side of a request: its queue of updates, merged when the reader lags
    responses.py    engine updates -> OpenAI response bodies and SSE chunks
    metrics.py      /metrics in Prometheus text
    app.py          the FastAPI routes, bearer-token auth, error handlers
    server.py       uvicorn around the app, graceful shutdown on SIGTERM / SIGINT

Only rlengine.cli imports this package (fastapi and uvicorn stay optional for everything else).
"""
