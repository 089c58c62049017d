"""What an engine request reports, collected: the sink tests hand to ``EngineRequest``, and
the loops that step an engine until its requests are done."""

import threading

from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest, Failed


class Sink:
    def __init__(self):
        self.events = []
        self.ended = threading.Event()  # set by Done or Failed (an engine on its own thread)

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Done, Failed)):
            self.ended.set()

    @property
    def done(self):
        return next((e for e in self.events if isinstance(e, (Done, Failed))), None)

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def tokens(self):
        return [t for e in self.events if isinstance(e, Delta) for t in e.token_ids]


def make_engine(model_tok, **kw) -> Engine:
    """An engine on ``(model, tokenizer)`` that logs nothing (``kw``: Engine's arguments)."""
    model, tok = model_tok
    kw.setdefault("log_interval", 0)
    return Engine(model, tok, **kw)


def drive(engine, sinks, limit=5000):
    """Step ``engine`` until every sink has its Done or Failed."""
    for _ in range(limit):
        if all(s.done is not None for s in sinks):
            return sinks
        engine.step()
    raise AssertionError("requests did not finish")


def run(engine, prompts, max_tokens=12, limit=3000, **kw) -> list:
    """One request per prompt (``kw``: EngineRequest's fields), stepped to the end; each
    must finish with Done. Returns their sinks."""
    sinks = [Sink() for _ in prompts]
    for p, s in zip(prompts, sinks):
        engine.submit(EngineRequest(prompt=list(p), max_tokens=max_tokens, on_event=s, **kw))
    drive(engine, sinks, limit)
    assert all(isinstance(s.done, Done) for s in sinks), [s.done for s in sinks]
    return sinks
