"""One rank of block-drafter decodes over a split model, for tests/test_distributed_block.py
(run on two ranks by ``rank_jobs.RankJobs``).

argv[1]: a JSON file holding a list of jobs {"name", "model", "mode", "drafter" (a block
drafter's directory), "oracle" (make the drafter an oracle, ``block_checks.make_oracle``),
"runs" ([source, K] pairs), "prompt" (ids), "max_tokens"}; argv[2]: where each rank writes its
results (``<argv[2]>.<rank>``): per job the mode, and per run the ids and the block and head
drafts accepted.
"""

import mlx.core as mx

from block_checks import decode, make_oracle
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.distributed import load_distributed
from mlx_mtp.models.io.loader import load_model
from rank_jobs import serve_jobs


def decodes(model, job) -> list:
    """Per run: the ids, and the drafts accepted from the drafter and from the head."""
    if job.get("oracle"):
        make_oracle(model)
    out = []
    for source, k in job["runs"]:
        tokens, dec = decode(model, job["prompt"], k, source, n=job["max_tokens"])
        s = dec.stats
        out.append({"tokens": tokens, "block": [s.block_draft_tokens, s.block_accepted_tokens],
                    "head": [s.head_draft_tokens, s.head_accepted_tokens]})
    return out


def single_process(job) -> list:
    model = load_model(job["model"])[0]
    attach_block_drafter(model, job["drafter"])
    return decodes(model, job)


def run(job, group) -> dict:
    model, _ = load_distributed(job["model"], job["mode"], group)
    attach_block_drafter(model, job["drafter"])
    result = {"mode": model.mode, "runs": decodes(model, job)}
    mx.synchronize()
    return result


if __name__ == "__main__":
    serve_jobs(run)
