"""``--draft-model`` with a block drafter on the command line: ``generate`` drafts with it
(``--draft-source block``, the default, and with ``--no-mtp``: no head loaded) and prints
plain decoding's text; a drafter that does not fit the model exits with code 2 and one
line; ``inspect`` reports its kind, taps and block. The CLI runs in this
process (the ``cli`` fixture): an exit code and the output are all a case needs."""


from block_checks import write_eagle3_oracle
from mlx_mtp.testing.tiny_block import make_tiny_dflash


def test_generate_inspect_and_a_misfit(tiny_ckpt, tmp_path, cli):
    trunk = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    good = make_tiny_dflash(tmp_path / "dflash", 64, 4096, [1, 3], 4, block_size=4)
    bad = make_tiny_dflash(tmp_path / "misfit", 64, 4096, [1, 7], 8, block_size=4)
    gen = ["generate", "--model", str(trunk), "--prompt", "def f():", "-m", "12", "--temp", "0"]
    code, plain, err = cli(*gen, "--verbose", "False", "--no-mtp")
    assert code == 0, err
    code, out, err = cli(*gen, "--draft-model", str(good), "--draft-source", "block",
                         "--fixed-k", "--num-draft-tokens", "3")
    assert code == 0, err
    assert plain.strip() in out and "head 0/0, block 0/36" in out, out  # 12 steps of 3
    code, out, err = cli(*gen, "--draft-model", str(good), "--fixed-k")  # default: block+mtp
    assert code == 0 and plain.strip() in out and ", block 0/" in out, out + err
    code, quiet, err = cli(*gen, "--draft-model", str(good), "--draft-source", "block",
                           "--verbose", "False")
    assert code == 0 and quiet == plain, err
    code, out, err = cli(*gen, "--draft-model", str(good), "--no-mtp", "--fixed-k")
    assert code == 0 and plain.strip() in out and "head 0/0, block 0/36" in out, out + err
    code, _, err = cli(*gen, "--draft-model", str(bad), "--draft-source", "block")
    assert code == 2 and "taps layers [1, 7]" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    code, out, err = cli("inspect", str(good))
    assert code == 0, err
    assert "dflash block drafter" in out and "[1, 3]" in out and "4 positions per pass" in out


def test_bench_compares_the_block_drafter_with_the_head(tiny_ckpt, tmp_path, cli):
    """``bench --draft-model D --draft-source mtp,block,block+mtp``: a row per source, each
    with plain decoding's output (the JSON's lossless flag) and the block drafter's drafts.
    The drafter is the EAGLE-3 oracle (right at every depth: 4 tokens a step at K 3), since
    one that does not pay pauses (``test_block_pause.py``)."""
    import json

    trunk = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    drafter = write_eagle3_oracle(trunk, tmp_path / "eagle3")
    code, out, err = cli("bench", "--model", str(trunk), "--draft-model", str(drafter),
                         "--draft-source", "mtp,block,block+mtp", "--num-draft-tokens", "0,3",
                         "--max-tokens", "8", "--repeats", "1", "--no-plots", "--quiet",
                         "-o", str(tmp_path / "out"))
    assert code == 0, err
    rows = {r["setting"]: r for r in
            json.loads((tmp_path / "out" / "inprocess.json").read_text())["settings"]}
    assert set(rows) >= {"plain", "K=3", "auto", "block", "block+mtp"}
    assert all(r["outputs_match_plain"] for r in rows.values())
    assert rows["block"]["num_draft_tokens"] > 0
