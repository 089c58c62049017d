"""One rank of block-drafter decodes over a split model, for tests/test_distributed_block.py
(run on two ranks by ``rank_jobs.RankJobs``).

argv[1]: a JSON file holding a list of jobs {"name", "model", "mode", "drafter" (a block
drafter's directory), "oracle" (make the drafter an oracle, ``block_checks.make_oracle``:
on a pipeline rank without the drafter, only its change to the embedding),
"runs" ([source, K] pairs), "prompt" (ids), "max_tokens"}; argv[2]: where each rank writes its
results (``<argv[2]>.<rank>``): per job the mode, the pipeline stage's layers, and per run the
ids, the block and head drafts made and accepted, and the drafter's proposals (None on a
pipeline rank without the drafter); the bytes the rank read while attaching the drafter, and
the drafter's weight bytes it holds.
"""

import mlx.core as mx
from mlx.utils import tree_flatten

from block_checks import make_oracle
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.distributed import load_distributed
from mlx_mtp.models.io.loader import load_model
from rank_jobs import serve_jobs


def decodes(model, job, drafts: bool = True) -> list:
    """Per run: the ids, whether each came from an accepted draft, the drafts made and
    accepted from the drafter and from the head, and (``drafts``: where the drafter runs)
    every drafter pass's proposals."""
    if job.get("oracle"):
        make_oracle(model)
    proposed = record_proposals(model.block_drafter) if drafts else []
    out = []
    for source, k in job["runs"]:
        proposed.clear()
        kk, drafter = DraftSources(source, adaptive=False).for_row(k)
        dec = MTPDecoder(model, kk, adaptive=False, drafter=drafter)
        steps = list(generate_step(job["prompt"], model, decoder=dec,
                                   max_tokens=job["max_tokens"]))
        s = dec.stats
        out.append({"tokens": [t for t, _, _ in steps],
                    "from_draft": [bool(d) for _, _, d in steps],  # each step's accepted run
                    "block": [s.block_draft_tokens, s.block_accepted_tokens],
                    "head": [s.head_draft_tokens, s.head_accepted_tokens],
                    "proposed": [p.tolist() for p in proposed] if drafts else None})
    return out


def record_proposals(drafter) -> list:
    """A list that gets every pass's proposals (B, n) of ``drafter`` (read after the step,
    whose sync computed them)."""
    proposed, propose = [], drafter.propose

    def recorded(anchor, cache, n, draw):
        picks, log_qs = propose(anchor, cache, n, draw)
        proposed.append(picks)
        return picks, log_qs

    drafter.propose = recorded
    return proposed


def zero_mask_embedding(model):
    """``make_oracle``'s change to the trunk on a pipeline rank without the drafter (which
    holds a stand-in): the mask token embeds to zero, on the rank that embeds tokens."""
    text, mask = model.text, model.block_drafter.spec.mask_token_id
    if model.layer_range[0] == 0:
        emb = text.model.embed_tokens.weight
        V = emb.shape[0]
        text.model.embed_tokens.weight = mx.where(mx.arange(V)[:, None] == mask, 0.0, emb)


def single_process(job) -> list:
    model = load_model(job["model"])[0]
    attach_block_drafter(model, job["drafter"])
    return decodes(model, job)


def bytes_read() -> int:
    """What this process has read from files so far (Linux's count of read() bytes)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def run(job, group) -> dict:
    model, _ = load_distributed(job["model"], job["mode"], group)
    before = bytes_read()
    attach_block_drafter(model, job["drafter"])
    drafter_read = bytes_read() - before  # its config and headers, and its weights if held
    held = sum(v.nbytes for _, v in tree_flatten(model.block_drafter.parameters()))
    if job.get("oracle") and not model.is_head:  # a pipeline stage: the trunk's part only
        job = dict(job, oracle=False)
        zero_mask_embedding(model)
    result = {"mode": model.mode, "runs": decodes(model, job, drafts=model.is_head),
              "stage": list(model.layer_range or ()), "drafter_read": drafter_read,
              "drafter_held": held}
    mx.synchronize()
    return result


if __name__ == "__main__":
    serve_jobs(run)
