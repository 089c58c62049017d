"""A checkpoint over one process's memory limit: refused in one process, loaded split.

Loading a rank's part runs no collective (ranks only talk once decoding starts), so each
rank's load is measured here in one process, with a stand-in group that names the rank;
decoding such a split model over two real ranks under the same cap is
``test_distributed.py::test_model_over_a_per_rank_memory_cap_runs_split``.
"""

import json

import mlx.core as mx
import pytest

from mlx_mtp.cli import main
from mlx_mtp.models.distributed import load_distributed
from mlx_mtp.models.io.loader import ModelLoadError, load_model, parameter_bytes
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_attention import make_tiny as make_tiny_attention
from mlx_mtp.testing.tiny_attention import tiny_config, to_hf, write_tiny

CAP_FRACTION = 0.7  # per-process memory limit, as a fraction of the whole model's weights


class RankOf:
    """The group as loading sees it: which rank of how many."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Many layers (half of them is well under the whole), sharded with an index."""
    return make_tiny(tmp_path_factory.mktemp("deep") / "m", "qwen3_5", head="random", seed=4,
                     num_layers=12, shards=3)


@pytest.fixture(scope="module")
def whole(deep) -> int:
    model, _ = load_model(deep)
    return parameter_bytes(model)


@pytest.fixture
def memory_limit():
    """Set this process's memory limit for one test, as ``mx.set_memory_limit`` does."""
    previous = []

    def set_limit(limit: int):
        previous.append(mx.set_memory_limit(limit))

    yield set_limit
    if previous:
        mx.set_memory_limit(previous[0])


def loaded_memory(load):
    """(active, peak) bytes the call to ``load`` allocated, and its result."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = load()
    return mx.get_active_memory() - base, mx.get_peak_memory() - base, out


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_each_rank_reads_only_its_share_under_the_cap(deep, whole, memory_limit, mode):
    cap = int(CAP_FRACTION * whole)
    memory_limit(cap)
    report = {}
    for rank in (0, 1):
        active, peak, (model, _) = loaded_memory(
            lambda: load_distributed(str(deep), mode, RankOf(rank, 2)))
        held = parameter_bytes(model.inner)
        report[rank] = (peak, held)
        assert held < cap < whole  # a part of the model, which alone is over the cap
        # the rank materialised its part only: nothing read is kept but its own tensors
        assert active <= held + 4096, (mode, rank, active, held)
        assert peak <= cap, (mode, rank, peak, cap)
        del model
    print(f"{mode}: whole {whole} B, cap {cap} B, per rank (peak, held): {report}")
    if mode == "pipeline":  # the two stages hold different layers, together every one
        assert report[0][1] + report[1][1] > whole


def test_one_process_refuses_a_model_over_its_memory_limit(tmp_path, memory_limit, capsys):
    # the tokenizer's whole vocabulary, so the CLI takes a text prompt
    path = make_tiny(tmp_path / "m", "qwen3_5", head="random", seed=5, vocab_size=4096)
    model, _ = load_model(path)
    memory_limit(int(CAP_FRACTION * parameter_bytes(model)))
    del model
    code = main(["generate", "--model", str(path), "--prompt", "hi", "-m", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "over this process's memory limit" in err and "--distributed" in err


def test_a_rank_over_its_limit_is_refused_before_reading(deep, whole, memory_limit):
    memory_limit(int(0.3 * whole))  # under half: one rank of two cannot hold its share
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    with pytest.raises(ModelLoadError, match="rank 1's share .* launch more ranks") as e:
        load_distributed(str(deep), "pipeline", RankOf(1, 2))
    assert "\n" not in str(e.value)
    assert mx.get_peak_memory() - base < 0.05 * whole  # refused from the headers: nothing read


def inspect_json(capsys, *argv) -> dict:
    assert main(["inspect", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_inspect_ranks_plans_what_each_rank_loads(deep, whole, capsys, mode):
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    report = inspect_json(capsys, deep, "--ranks", 2, "--distributed", mode)
    # headers and shapes only: under 1% of the model allocated (a layer is 7% of it)
    assert mx.get_peak_memory() - base < 0.01 * whole
    plan = report["ranks"]
    assert plan["mode"] == mode and plan["mtp_head_ranks"] == ([0] if mode == "pipeline"
                                                               else [0, 1])
    memory = report["memory"]
    for r in plan["per_rank"]:
        model, _ = load_distributed(str(deep), mode, RankOf(r["rank"], 2))
        held = parameter_bytes(model.inner)
        if mode == "pipeline":  # the plan is the split the load makes, byte for byte
            assert tuple(r["layers"]) == model.layer_range and r["weights_bytes"] == held
        else:  # estimated: the MTP layer counted whole, norms counted split
            assert r["layers"] == [0, 12] and abs(r["weights_bytes"] - held) < 0.1 * held
        del model
    kv = [r["kv_bytes_per_1k_tokens"] for r in plan["per_rank"]]
    state = [r["state_bytes_per_sequence"] for r in plan["per_rank"]]
    assert sum(kv) == memory["kv_bytes_per_1k_tokens"]  # every layer's cache on one rank
    assert sum(state) == memory["state_bytes_per_sequence"]  # (or split by heads)
    if mode == "tensor":
        assert kv[0] == kv[1] and state[0] == state[1]


def test_inspect_ranks_says_which_split_is_not_available(tmp_path, capsys):
    mimo = make_tiny_attention(tmp_path / "mimo", "mimo", "random")
    report = inspect_json(capsys, mimo, "--ranks", 2)
    assert report["ranks"]["mode"] == "pipeline"
    assert report["ranks"]["unavailable"] == {"tensor": "mimo has no tensor split",
                                              "expert": "mimo has no expert split"}
    assert main(["inspect", str(mimo), "--ranks", "2"]) == 0
    assert "no tensor    mimo has no tensor split" in capsys.readouterr().out
    assert main(["inspect", str(mimo), "--ranks", "2", "--distributed", "tensor"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tensor split" in err and "Traceback" not in err


def test_inspect_ranks_of_a_drafter_alone_is_refused_in_one_line(deep, tmp_path, capsys):
    from mlx_mtp.convert.main import convert

    drafter = tmp_path / "m-MTP"
    convert(deep, tmp_path / "m", split_mtp=drafter, verbose=False)
    assert main(["inspect", str(drafter), "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a drafter alone" in err


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """A DeepSeek-V3 whose routed experts (32 per MoE layer) are most of its bytes, in two
    shards of the released per-expert layout."""
    def config(**c):
        return dict(tiny_config("deepseek_v3", **c), n_routed_experts=32, n_group=4,
                    topk_group=2)

    return write_tiny(tmp_path_factory.mktemp("experts") / "m", config, to_hf, "random",
                      num_layers=6, num_shards=2)


def test_expert_split_plans_and_reads_each_rank_s_experts_under_the_cap(
        many_experts, memory_limit, capsys):
    """``--distributed expert``: the plan is what each rank loads, byte for byte (its
    experts; the shared experts on rank 0), K/V whole on every rank (attention is
    replicated); a model over one process's cap loads under it on each of two ranks."""
    model, _ = load_model(many_experts)
    whole = parameter_bytes(model)
    del model
    report = inspect_json(capsys, many_experts, "--ranks", 2, "--distributed", "expert")
    plan = report["ranks"]
    assert plan["mode"] == "expert" and plan["mtp_head_ranks"] == [0, 1]
    kv = report["memory"]["kv_bytes_per_1k_tokens"]
    assert [r["kv_bytes_per_1k_tokens"] for r in plan["per_rank"]] == [kv, kv]
    cap = int(CAP_FRACTION * whole)
    memory_limit(cap)
    with pytest.raises(ModelLoadError, match="over this process's memory limit"):
        load_model(many_experts)
    for r in plan["per_rank"]:
        active, peak, (model, _) = loaded_memory(
            lambda: load_distributed(str(many_experts), "expert", RankOf(r["rank"], 2)))
        held = parameter_bytes(model.inner)
        assert r["layers"] == [0, 6] and r["weights_bytes"] == held
        assert held < cap < whole
        # none of the other rank's experts (over 40% of the model); the few KB over its
        # parameters are what one process keeps too (MLA's kv_b_proj, read whole)
        assert active <= 1.02 * held, (r["rank"], active, held)
        assert peak <= cap, (r["rank"], peak, cap)
        print(f"expert rank {r['rank']}: whole {whole} B, cap {cap} B, peak {peak} B, "
              f"held {held} B")
        del model
