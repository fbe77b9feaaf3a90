"""The teacher cache (`loss.teacher_top_k`): GKD speed with a warm cache, and what top-k costs in accuracy.

1. Speed, each mode in its own `mlx distill` process with the same student, text, batch and
   steps (median tokens/s over the steps after the first):
     plain      the student alone on the LM loss (no teacher): the ceiling
     kl         logit KL against the teacher run on every step (no cosine term)
     cached     the same KL from a warm cache of the teacher's top-K (`loss.teacher_top_k=K`),
                after one run that filled it on the same sequences
     shipped    the shipped gkd recipe
2. Accuracy: on held-out wikitext-2 test sequences, the top-K-plus-one-bucket KL of the child
   against the parent beside the full KL, for several K.

    python bench/bench_teacher_cache.py --student runs/bench_quality/children/h100-1.5x/puzzle --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gkd_speed as speed  # noqa: E402  (the GKD speed benchmark's runner)


def accuracy(student: str, teacher: str, top_ks: list[int], sequences: int, seq_len: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from mlxkit.engines.data.text import pack, read_texts, tokenize
    from mlxkit.engines.distill.losses import top_k_kl
    from mlxkit.engines.eval.metrics import kl_from_log_probs
    from mlxkit.engines.models.loading import load_model

    parent, child = load_model(teacher), load_model(student, with_tokenizer=False).model
    ids = pack(tokenize(parent.tokenizer, read_texts(speed.SHARED / "wikitext2-test.txt"), sequences * seq_len),
               seq_len)
    rows = []
    with torch.no_grad():
        p = F.log_softmax(parent.model(ids).logits[:, :-1].float(), -1)
        q = F.log_softmax(child(ids).logits[:, :-1].float(), -1)
        full = kl_from_log_probs(p, q).mean().item()
        for k in top_ks:
            top = p.topk(k, -1)
            approx = top_k_kl(top.values.reshape(-1, k), top.indices.reshape(-1, k), q.reshape(-1, q.shape[-1]))
            mass = top.values.exp().sum(-1).mean().item()
            rows.append({"top_k": k, "full_kl": full, "top_k_kl": approx.mean().item(),
                         "relative_error": approx.mean().item() / full - 1, "teacher_mass_in_top_k": mass})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--accuracy-top-ks", default="16,64,256,1024")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shape = (args.steps, args.batch, args.micro, args.seq_len)
    kl_only = {"loss.cosine_weight": 0}
    cached = {**kl_only, "loss.teacher_top_k": args.top_k}
    with tempfile.TemporaryDirectory() as tmp:
        results = {"plain": speed.run("plain", args.student, args.teacher, *shape, Path(tmp))}
        results["kl"] = speed.run("kl", args.student, args.teacher, *shape, Path(tmp), extra=kl_only)
        speed.run("fill", args.student, args.teacher, *shape, Path(tmp), extra=cached)  # fills the cache
        results["cached"] = speed.run("cached", args.student, args.teacher, *shape, Path(tmp), extra=cached)
        results["shipped"] = speed.run("gkd", args.student, args.teacher, *shape, Path(tmp))
    plain = results["plain"]["median_tokens_per_s"]
    report = {"student": args.student, "batch": args.batch, "seq_len": args.seq_len, "top_k": args.top_k,
              "speed": {mode: {**r, "over_plain": r["median_tokens_per_s"] / plain} for mode, r in results.items()},
              "accuracy": accuracy(args.student, args.teacher, [int(k) for k in args.accuracy_top_ks.split(",")],
                                   4, args.seq_len),
              "load_average": os.getloadavg()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
