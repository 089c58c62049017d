"""One FastAPI router per API, each built the same way: ``router(pipe) -> APIRouter``.

The routes only translate a request for the shared request path (``server/pipeline.py``)
and pick a formatter; ``server/app.py`` includes every router of ``APIS`` in one loop.
"""

from . import anthropic, dashboard, openai, responses, status

# In the order the app includes them (no two share a path).
APIS = (status, openai, anthropic, responses, dashboard)
