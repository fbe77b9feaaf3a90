"""Merge quality on four real text domains with SmolLM2-135M; resumable stage by stage.

Stages (each skipped when its output exists under --work):
  data       tokenise the domains; train / validation (alpha sweep) / held-out test blocks
  finetune   one short full fine-tune (fp32, AdamW) of the base per domain -> work/ft-<domain>
  eval       held-out loss of the base and of each fine-tune on every domain
  merge      merge the four fine-tunes with every method (α: sweep on the validation blocks for
             task-vector methods), then held-out loss per domain and the normalised score
             (base loss − merged loss) / (base loss − own fine-tune loss), averaged over domains;
             regmean and fisher calibrate on an equal share of every domain's validation text

Domains: wikitext-2 valid, tinyshakespeare, the Python standard library's .py files, and
software licence texts (/usr/share/common-licenses), none of which overlaps the others.

  python bench/bench_merge_quality.py --steps 200          # everything (about 1 h on 2 cores)
  python bench/bench_merge_quality.py --only finetune --domains python
  python bench/bench_merge_quality.py --only merge --methods iso-c,iso-cts
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.eval.language_model import evaluate

ROOT = Path(__file__).resolve().parents[1]
BASE = "smollm2-135m"
METHODS = ["iso-c", "iso-cts", "task-arithmetic", "ties", "dare-ties", "dare-linear", "linear", "slerp", "regmean",
           "fisher"]
# The data-aware methods' calibration budget (their default), shared equally by the domains.
CALIBRATION_TOKENS = 8192
METHOD_PARAMS = {"ties": {"density": 0.2}, "dare-ties": {"drop_rate": 0.9}, "dare-linear": {"drop_rate": 0.9},
                 "slerp": {"t": 0.5}}
ALPHA_GRID = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0]
# Checks of the fast spectral kernels at the merged-model level, at the α their fast method chose:
# the official full-SVD implementations, and Iso-CTS with the randomized residual directions forced on
# every tall matrix (SmolLM2's are all narrow enough for the exact path by default).
VARIANTS = {"iso-c@official": ("iso-c", {"exact": True}), "iso-cts@official": ("iso-cts", {"exact": True}),
            "iso-cts@randomized": ("iso-cts", {"exact_below": 0})}


def domain_texts() -> dict[str, str]:
    shared = Path("/work/shared/data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    py = sorted(p for p in stdlib.glob("*.py"))  # top-level modules only: plenty of text, deterministic
    licenses = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    return {
        "wikitext": (shared / "wikitext2-valid.txt").read_text(errors="replace"),
        "shakespeare": (shared / "tinyshakespeare.txt").read_text(errors="replace"),
        "python": "\n\n".join(p.read_text(errors="replace") for p in py),
        "licenses": "\n\n".join(p.read_text(errors="replace") for p in licenses),
    }


def stage_data(work: Path, tokenizer, seq_len: int, train_blocks: int, val_blocks: int, test_blocks: int) -> dict:
    path = work / "data.pt"
    if path.exists():
        return torch.load(path)
    data = {}
    for name, text in domain_texts().items():
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        n = ids.numel() // seq_len
        blocks = ids[: n * seq_len].view(n, seq_len)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        need = val_blocks + test_blocks
        if n < need + 8:
            raise SystemExit(f"domain {name}: only {n} blocks of {seq_len} tokens")
        test, val, train = blocks[order[:test_blocks]], blocks[order[test_blocks:need]], blocks[order[need:]]
        data[name] = {"train": train[:train_blocks], "val": val, "test": test}
        print(f"data {name}: {n} blocks ({ids.numel()} tokens); train {min(train_blocks, len(train))}, "
              f"val {val_blocks}, test {test_blocks}", flush=True)
    torch.save(data, path)
    return data


def stage_finetune(work: Path, domain: str, blocks: torch.Tensor, steps: int, batch: int, lr: float) -> Path:
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.models.saving import save_model

    out = work / f"ft-{domain}"
    if (out / "config.json").exists():
        return out
    loaded = load_model(BASE)
    model, tok = loaded.model, loaded.tokenizer
    model.train()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, blocks.shape[0], (batch,), generator=gen)
        ids = blocks[idx]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"finetune {domain} step {step + 1}/{steps} loss {loss.item():.4f} "
                  f"({(time.perf_counter() - start) / (step + 1):.2f} s/step)", flush=True)
    model.eval()
    manifest = Manifest(verb="bench-finetune")
    manifest.settings = {"domain": domain, "steps": steps, "batch": batch, "seq_len": blocks.shape[1], "lr": lr}
    save_model(model, tok, out, manifest, overwrite=True)
    return out


def losses(model_dir: str, data: dict, split: str) -> dict[str, float]:
    from mlxkit.engines.models.loading import load_model

    model = load_model(model_dir, with_tokenizer=False).model
    return {d: evaluate(model, v[split]).nll for d, v in data.items()}


def stage_eval(work: Path, data: dict, domains: list[str]) -> dict:
    path = work / "eval.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    if "base" not in res:
        res["base"] = losses(BASE, data, "test")
    for d in domains:
        if f"ft-{d}" not in res:
            res[f"ft-{d}"] = losses(str(work / f"ft-{d}"), data, "test")
        path.write_text(json.dumps(res, indent=2))
        print(f"eval ft-{d}: " + ", ".join(f"{k} {v:.4f}" for k, v in res[f"ft-{d}"].items()), flush=True)
    print("eval base: " + ", ".join(f"{k} {v:.4f}" for k, v in res["base"].items()), flush=True)
    return res


def stage_merge(work: Path, data: dict, domains: list[str], methods: list[str], evals: dict) -> dict:
    from mlxkit.engines.merge.config import validate_config
    from mlxkit.engines.merge.methods.registry import get
    from mlxkit.engines.merge.run import run_merge
    from mlxkit.engines.models.loading import resolve_spec

    path = work / "merge_results.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    base_dir = str(resolve_spec(BASE).path)
    val_files = []
    for d in domains:  # validation text for the α sweep: the val blocks, decoded once
        f = work / f"val-{d}.txt"
        if not f.exists():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(base_dir)
            f.write_text(tok.decode(data[d]["val"].reshape(-1)))
        val_files.append(str(f))
    calibration = work / "calibration.txt"
    if not calibration.exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base_dir)
        share = CALIBRATION_TOKENS // len(domains) - 64  # slack: decoding then encoding again may shift a few tokens
        calibration.write_text("\n\n".join(tok.decode(data[d]["val"].reshape(-1)[:share]) for d in domains))
    for method in methods:
        if method in res:
            continue
        models = [str(work / f"ft-{d}") for d in domains]
        name, params = VARIANTS.get(method, (method, METHOD_PARAMS.get(method, {})))
        cfg = {"merge_method": name, "base_model": base_dir, "parameters": params}
        if method == "slerp":
            models = models[:2]
        if method in VARIANTS:
            if name not in res:
                raise SystemExit(f"{method} reuses the α of {name}: merge {name} first")
            cfg.update(alpha=res[name]["alpha"])
        elif get(method).uses_deltas:
            cfg.update(alpha="auto", eval_data=val_files, alpha_grid=ALPHA_GRID, eval_tokens=4096, eval_seq_len=256)
        if get(name).statistics is not None:
            cfg.update(data=str(calibration), calibration_tokens=CALIBRATION_TOKENS)
        cfg["models"] = [{"model": m} for m in models]
        out = work / f"merged-{method}"
        start = time.perf_counter()
        result = run_merge(validate_config(cfg), out, overwrite=True, device="cpu")
        merge_s = time.perf_counter() - start
        test = losses(str(out), data, "test")
        norm = {d: (evals["base"][d] - test[d]) / (evals["base"][d] - evals[f"ft-{d}"][d]) for d in domains}
        res[method] = {"alpha": result.get("alpha"), "merge_and_sweep_s": round(merge_s, 1),
                       "test_loss": test, "normalised": norm,
                       "mean_normalised": sum(norm.values()) / len(norm), "merged_models": len(models),
                       "alpha_curve": result.get("alpha_curve")}
        path.write_text(json.dumps(res, indent=2))
        print(f"merge {method:16s} α={result.get('alpha')}  " + "  ".join(f"{d} {test[d]:.4f}" for d in domains)
              + f"  mean normalised {res[method]['mean_normalised']:.3f}  ({merge_s:.0f} s)", flush=True)
    return res


def print_table(evals: dict, results: dict, domains: list[str]) -> None:
    """Markdown: held-out loss per domain for the base, each fine-tune and each merge, plus the normalised score."""
    print("\n| model | α | " + " | ".join(domains) + " | mean normalised |")
    print("|---|---|" + "---|" * len(domains) + "---|")
    print("| base | – | " + " | ".join(f"{evals['base'][d]:.4f}" for d in domains) + " | 0 |")
    for t in domains:
        own = {d: evals[f"ft-{t}"][d] for d in domains}
        print(f"| fine-tune {t} | – | " + " | ".join(f"**{own[d]:.4f}**" if d == t else f"{own[d]:.4f}"
                                                  for d in domains) + " | – |")
    for method, r in results.items():
        alpha = "–" if r.get("alpha") is None else f"{r['alpha']:g}"
        print(f"| {method} | {alpha} | " + " | ".join(f"{r['test_loss'][d]:.4f}" for d in domains)
              + f" | {r['mean_normalised']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "runs" / "merge_quality"))
    ap.add_argument("--only", choices=["data", "finetune", "eval", "merge"], default=None)
    ap.add_argument("--domains", default="wikitext,shakespeare,python,licenses")
    ap.add_argument("--methods", default=",".join(METHODS + list(VARIANTS)))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--val-blocks", type=int, default=16)
    ap.add_argument("--test-blocks", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    domains = args.domains.split(",")
    from transformers import AutoTokenizer

    from mlxkit.engines.models.loading import resolve_spec

    tok = AutoTokenizer.from_pretrained(str(resolve_spec(BASE).path))
    data = stage_data(work, tok, args.seq_len, args.steps * args.batch, args.val_blocks, args.test_blocks)
    if args.only == "data":
        return
    if args.only in (None, "finetune"):
        for d in domains:
            stage_finetune(work, d, data[d]["train"], args.steps, args.batch, args.lr)
        if args.only:
            return
    evals = stage_eval(work, data, domains)
    if args.only == "eval":
        return
    results = stage_merge(work, data, domains, args.methods.split(","), evals)
    print_table(evals, results, domains)


if __name__ == "__main__":
    main()
