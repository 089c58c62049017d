"""One rank of distributed decodes, for the tests/test_distributed*.py modules (run on
two ranks by ``rank_jobs.RankJobs``).

argv[1]: a JSON file holding a list of jobs {"name", "model", "mode", "ks", "prompt" (ids),
"max_tokens", "temp", "seed", "memory_limit" (bytes, optional), "mtp_model" (a split
drafter, optional), "logits" (optional: also the prompt's last-row logits and the MTP
head's), "kv_bits" (optional: [bits, group size], ``--kv-bits``), "serve" (optional: K;
instead of the decodes, a batch of 4 served by the engine, ``engine_batch.py``)}; argv[2]: where each rank
writes its results (``<argv[2]>.<rank>``, one entry per job): the mode, the ids and accepted
drafts per K, its layer range, memory after loading, bytes and messages it sent, the kinds
of the caches it makes.
"""

import mlx.core as mx

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.distributed import load_distributed
from engine_batch import serve_batch
from rank_jobs import serve_jobs


def run(job, group) -> dict:
    limit = job.get("memory_limit")
    previous = mx.set_memory_limit(limit) if limit else None
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model, tokenizer = load_distributed(job["model"], job.get("mode"), group,
                                        mtp=max(job["ks"]) > 0, mtp_model=job.get("mtp_model"))
    if "serve" in job:
        return {"mode": model.mode, "served": serve_batch(model, tokenizer, job["serve"], group)}
    loaded = {"active": mx.get_active_memory() - base, "peak": mx.get_peak_memory() - base}
    if job.get("kv_bits"):
        model.use_kv_quantization(KVQuantization(*job["kv_bits"]))
    logits = prompt_logits(model, job["prompt"]) if job.get("logits") else None
    sampling = SamplingParams(temperature=job.get("temp", 0.0), seed=job.get("seed"))
    tokens, accepted = {}, {}
    for k in job["ks"]:
        out = list(generate_step(job["prompt"], model, num_draft_tokens=k, sampling=sampling,
                                 max_tokens=job["max_tokens"], adaptive=False))
        tokens[k] = [t for t, _, _ in out]
        accepted[k] = sum(drafted for _, _, drafted in out)
    mx.synchronize()
    if previous is not None:
        mx.set_memory_limit(previous)
    return {"mode": model.mode, "tokens": tokens, "accepted": accepted,
            "layer_range": model.layer_range,
            "loaded": loaded, "bytes_sent": model.bytes_sent, "messages": model.messages,
            "logits": logits,
            "cache_kinds": sorted({c.kind for c in model.make_cache() + model.make_mtp_cache()})}


def prompt_logits(model, prompt) -> list:
    """The trunk's and the MTP head's logits at the prompt's last row (float32 lists)."""
    ids = mx.array([prompt])
    hidden, head_in = model.trunk(ids, model.make_cache())
    out = [model.logits(hidden[:, -1:])]
    if model.num_mtp_layers:
        mtp = model.mtp_forward(head_in[:, :-1], ids[:, 1:], model.make_mtp_cache())
        out.append(model.draft_logits(mtp[:, -1:]))  # a stream family's head mixes first
    return [o.astype(mx.float32).reshape(-1).tolist() for o in out]


if __name__ == "__main__":
    serve_jobs(run)
