"""What an engine request reports, collected: the sink tests hand to ``EngineRequest``."""

from mlx_mtp.server.engine import Delta, Done, Failed


class Sink:
    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def done(self):
        return next((e for e in self.events if isinstance(e, (Done, Failed))), None)

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def tokens(self):
        return [t for e in self.events if isinstance(e, Delta) for t in e.token_ids]
