"""A batch of 4 served by ``serve``'s engine without HTTP: in one process, or split over the
ranks of a group (rank 0's ``Engine`` with a ``LeaderSync`` schedules, the other ranks replay
it with a ``Follower``), as ``mlx-mtp serve --distributed`` runs them. Rank jobs with a
"serve" entry run it (``distributed_rank.py``), so every family and split kind is served on
the modules' shared pair of ranks without a cluster of its own; the HTTP side is the same for
every family (``test_distributed_serve.py`` and one served cluster per module).

Two rows start together and two join a step later (rows joining at different steps, left
padding), K fixed, so every step drafts and each row rolls back its own rejections.
"""

from functools import cache
from pathlib import Path

from mlx_mtp.models.io.loader import load_model, load_tokenizer
from mlx_mtp.server.distributed import Follower, LeaderSync
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import EngineRequest

# ids below 128: every tiny family's vocabulary
PROMPTS = [[1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18], [30, 31, 2, 64, 50, 77],
           [8, 40, 11, 3, 5, 9, 22, 7, 13, 100, 20, 42, 17, 18, 4], [120, 6, 60]]
MAX_TOKENS = 8


def serve_batch(model, tokenizer, k: int, group=None) -> dict:
    """Each request's tokens, in ``PROMPTS`` order, and the drafts the batch made (rank 0's;
    a follower returns None)."""
    if group is not None and group.rank() > 0:
        code = Follower(model).run()
        assert code == 0, "the follower lost rank 0"
        return None
    sync = None
    if group is not None:
        sync = LeaderSync(model, timeout=3600.0)  # the watchdog must not fire after the job
    engine = Engine(model, tokenizer, num_draft_tokens=k, adaptive=False, calibrate=False,
                    log_interval=0, sync=sync)
    if sync is not None:
        sync.attach(engine)
    emitted = [[] for _ in PROMPTS]

    def request(i):
        def on_event(ev):
            emitted[i].extend(getattr(ev, "token_ids", ()))
        return EngineRequest(prompt=PROMPTS[i], max_tokens=MAX_TOKENS, on_event=on_event)

    for i in (0, 1):
        engine.submit(request(i))
    engine.step()
    for i in (2, 3):
        engine.submit(request(i))
    while engine.step() or engine.num_waiting:
        pass
    if sync is not None:
        sync.stopped()
    return {"tokens": emitted, "drafted": engine.total_stats.num_draft_tokens}


@cache  # per checkpoint and K: a module's jobs compare with one reference
def served_alone(path, k: int) -> dict:
    """``serve_batch`` in this process, the reference of the ranks' (the same engine)."""
    model, config = load_model(Path(path))
    return serve_batch(model, load_tokenizer(Path(path), config), k)


def assert_served_as_one_process(r0: dict, r1: dict, mode: str, path, k: int):
    """Rank 0's and rank 1's results of a ``"serve"`` job: rows joining at different steps
    answer as one process's engine token for token, rank 1 only followed, and MTP drafted."""
    assert r0["mode"] == r1["mode"] == mode
    tokens = served_alone(path, k)["tokens"]
    assert all(tokens) and len({tuple(t) for t in tokens}) == len(tokens)
    assert r0["served"]["tokens"] == tokens and r1["served"] is None  # rank 1 only follows
    assert r0["served"]["drafted"] > 0  # MTP drafted in the batch over the ranks
