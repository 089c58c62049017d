"""A block drafter (DFlash; EAGLE-3) in the server's engine: requests choosing ``draft_source`` ``block``,
``mtp`` or ``both`` batch together and decode plain decoding's tokens; usage and /metrics
count the block drafter's drafts by source."""

import pytest

from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block, make_tiny_dflash

PROMPT = list(range(300, 320)) + [7, 8]


@pytest.fixture(scope="module", params=["dflash", "eagle3"])
def served(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("block_engine")
    model, tok = load(str(make_tiny(tmp / "ckpt", "qwen3_5", "noisy", vocab_size=4096,
                                    trunk_scale=0.1)))
    drafter = (make_tiny_dflash(tmp / "dflash", 64, 4096, [0, 2], 4, block_size=4)
               if request.param == "dflash" else
               make_tiny_block(tmp / "eagle3", "eagle3", 64, 4096, [0, 2, 3], 4, block_size=4,
                               draft_vocab_size=1024))
    attach_block_drafter(model, str(drafter))
    return model, tok


def _run(engine, requests):
    """Submit every request at once, step until all are done: tokens and Done events."""
    sinks = []
    for kw in requests:
        events = []
        engine.submit(EngineRequest(prompt=list(PROMPT), max_tokens=24, on_event=events.append,
                                    **kw))
        sinks.append(events)
    for _ in range(2000):
        if all(any(isinstance(e, Done) for e in s) for s in sinks):
            break
        engine.step()
    tokens = [[t for e in s if isinstance(e, Delta) for t in e.token_ids] for s in sinks]
    return tokens, [next(e for e in s if isinstance(e, Done)) for s in sinks]


def test_requests_mixing_the_block_drafter_with_other_sources(served):
    model, tok = served
    engine = Engine(model, tok, num_draft_tokens=3, log_interval=0, calibrate=False,
                    draft_sources=DraftSources("both"))
    tokens, done = _run(engine, [dict(num_draft_tokens=0), dict(draft_source="block"),
                                 dict(draft_source="mtp"),
                                 dict(draft_source="block", num_draft_tokens=2), dict()])
    assert all(t == tokens[0] for t in tokens[1:])
    by_source = [d.usage["draft_tokens_by_source"] for d in done]
    for i in (1, 3):
        assert by_source[i]["block"]["drafted"] > 0 == by_source[i]["mtp"]["drafted"]
    assert "block" not in by_source[2] and by_source[2]["mtp"]["drafted"] > 0
    assert 'source="block"' in engine.metrics.render()


def test_a_server_without_the_head_drafts_from_the_block_drafter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("headless_engine")
    model, tok = load(str(make_tiny(tmp / "ckpt", "qwen3_5", "noisy", vocab_size=4096,
                                    trunk_scale=0.1)), mtp=False)
    attach_block_drafter(model, str(make_tiny_dflash(tmp / "dflash", 64, 4096, [0, 2], 4,
                                                     block_size=4)))
    engine = Engine(model, tok, num_draft_tokens=3, log_interval=0, calibrate=False,
                    draft_sources=DraftSources("block+mtp"))
    tokens, done = _run(engine, [dict(num_draft_tokens=0), dict(), dict(draft_source="block")])
    assert all(t == tokens[0] for t in tokens[1:])
    for d in done[1:]:
        by_source = d.usage["draft_tokens_by_source"]
        assert by_source["block"]["drafted"] > 0 == by_source["mtp"]["drafted"]


def test_a_block_source_on_a_server_without_a_block_drafter_is_a_400():
    from types import SimpleNamespace

    from mlx_mtp.server.params import resolve_common
    from mlx_mtp.server.protocol import APIError, ChatCompletionRequest

    def resolve(block_drafter: bool, source: str):
        state = SimpleNamespace(aliases={"m"}, model_name="m", vocab_size=16,
                                context_length=64, default_max_tokens=8, num_mtp_layers=1,
                                sampling_defaults={}, block_drafter=block_drafter)
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "draft_source": source})
        return resolve_common(state, req, 4, None)

    for source in ("block", "block+mtp"):
        assert resolve(True, source)["draft_source"] == source
        with pytest.raises(APIError) as e:
            resolve(False, source)
        assert e.value.status == 400 and e.value.param == "draft_source"
        assert "--draft-model" in e.value.message
