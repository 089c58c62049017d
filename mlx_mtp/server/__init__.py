"""OpenAI-compatible HTTP server with continuous batching and MTP speculative decoding.

Modules:

* ``app``: FastAPI application and the ``mlx-mtp serve`` command.
* ``protocol``: request models (pydantic) and the OpenAI error envelope.
* ``prompts``: messages and chat template -> prompt tokens (+ prefix-cache boundaries).
* ``responses``: response bodies and SSE chunks.
* ``engine``: the scheduler thread that owns the model (decoding via ``mlx_mtp.decode.batch``).
* ``parsers``: reasoning (``<think>``) and tool-call parsing.
* ``prefix_cache``: reusable prompt-prefix states for hybrid models.
* ``metrics``: Prometheus counters, gauges and histograms.
"""
