"""OpenAI-compatible HTTP server with continuous batching and MTP speculative decoding.

Modules:

* ``app``: FastAPI application (middleware, error envelopes, the routers).
* ``routers``: one ``APIRouter`` per API, each built by ``router(pipe)``.
* ``pipeline``: the request path every API shares (auth, parsing, submission, body or SSE).
* ``protocol``: request models (pydantic) and the OpenAI error envelope.
* ``prompts``: messages and chat template -> prompt tokens (+ prefix-cache boundaries).
* ``responses``: response bodies and SSE chunks.
* ``engine``: the scheduler thread that owns the model (decoding via ``mlx_mtp.decode.batch``).
* ``output``: the engine's output side (text, logprobs, finish, usage and timings).
* ``parsers``: reasoning (``<think>``) and tool-call parsing.
* ``prefix_cache``: reusable prompt-prefix states for hybrid models.
* ``metrics``: Prometheus counters, gauges and histograms.
"""
