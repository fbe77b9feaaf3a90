"""Which calibration text should `mlx search` use when the user gives no --data?

Each option is a text of the same token count, written to a file and given as --data to
every stage, so the options differ in their text alone:

  sampled-t1    text sampled from the parent at temperature 1 (the product's default before this benchmark)
  sampled-t0.8  text sampled from the parent at temperature 0.8
  shakespeare   public-domain text (tinyshakespeare), the kind of corpus a package can ship
  mix           half sampled-t1, half shakespeare, interleaved by sequence

For each: the `quick` block library (`mlx library build`), the h100-1.5x child (`mlx search
--refine 0`), the same GKD budget on the option's own text, and `mlx eval` of the child on the
first 8,192 tokens of wikitext-2 test (never used for calibration) before and after GKD.

    python bench/bench_calibration_default.py --work runs/bench_calibration
    python bench/bench_calibration_default.py --work runs/bench_calibration --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_puzzle_quality as quality  # noqa: E402  (the quality benchmark's stages)

OPTIONS = ("sampled-t1", "sampled-t0.8", "shakespeare", "mix")
SEQ_LEN = 512
# Enough 512-token sequences for the quick recipe's 26 x 256 BLD tokens and GKD's 32 cycled sequences + 4 held out.
SEQUENCES = 36


def sampled_rows(temperature: float) -> "list[list[int]]":
    from mlxkit.engines.data.sampled import sample_tokens
    from mlxkit.engines.models.loading import load_model

    loaded = load_model(quality.PARENT)
    return sample_tokens(loaded.model, loaded.tokenizer, n_sequences=SEQUENCES, seq_len=SEQ_LEN, seed=0,
                         temperature=temperature).tolist()


def corpus_rows() -> "list[list[int]]":
    from mlxkit.engines.data.text import pack, read_texts, tokenize
    from mlxkit.engines.models.loading import load_tokenizer, resolve_spec

    tokenizer = load_tokenizer(resolve_spec(quality.PARENT))
    ids = tokenize(tokenizer, read_texts(quality.SHARED / "tinyshakespeare.txt"), SEQUENCES * SEQ_LEN)
    return pack(ids, SEQ_LEN).tolist()


def option_text(work: Path, option: str) -> Path:
    """The option's rows decoded to text, one row a document, in a file for --data."""
    path = work / "texts" / f"{option}.txt"
    if path.exists():
        return path
    from mlxkit.engines.models.loading import load_tokenizer, resolve_spec

    tokenizer = load_tokenizer(resolve_spec(quality.PARENT))
    if option == "mix":
        a, b = sampled_rows(1.0), corpus_rows()
        rows = [row for pair in zip(a[:SEQUENCES // 2], b[:SEQUENCES // 2]) for row in pair]
    elif option == "shakespeare":
        rows = corpus_rows()
    else:
        rows = sampled_rows(float(option.removeprefix("sampled-t")))
    text = "\n\n".join(tokenizer.decode(row, skip_special_tokens=True).strip() for row in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def run_option(work: Path, option: str, gkd_tokens: int) -> None:
    text = option_text(work, option)
    library = work / "libraries" / option
    quality.cached(work / "records" / f"library-{option}.json", lambda: quality.run_json(
        ["library", "build", "--recipe", "quick", "--data", str(text), "--out", str(library)],
        work / "logs" / f"library-{option}.log"))
    child = work / "children" / option
    quality.cached(work / "records" / f"child-{option}.json", lambda: quality.run_json(
        ["search", "--library", str(library), "--target", "h100", "--throughput", "1.5x", "--refine", "0",
         "--out", str(child), "--overwrite"], work / "logs" / f"search-{option}.log"))
    quality.evaluate(work, str(child), f"{option}-child")
    if not gkd_tokens:
        return
    distilled = work / "children" / f"{option}-gkd{gkd_tokens}"
    quality.cached(work / "records" / f"gkd-{option}-{gkd_tokens}.json", lambda: quality.run_json(
        ["distill", "--gkd", "--teacher", quality.PARENT, "--student", str(child), "--data", str(text),
         "--tokens", str(gkd_tokens), "--out", str(distilled)], work / "logs" / f"gkd-{option}.log"))
    quality.evaluate(work, str(distilled), f"{option}-gkd{gkd_tokens}")


def report(work: Path, gkd_tokens: int) -> str:
    parent = json.loads((work / "evals" / "parent.json").read_text())
    lines = [f"Parent perplexity {parent['perplexity']:.2f} on wikitext-2 test ({parent['tokens']} tokens).\n",
             f"| calibration text | parent ppl on it | child ppl | child / parent | ppl after {gkd_tokens:,} GKD tokens "
             "| after / parent | KL after |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for option in OPTIONS:
        before, after = work / "evals" / f"{option}-child.json", work / "evals" / f"{option}-gkd{gkd_tokens}.json"
        own = work / "evals" / f"parent-on-{option}.json"
        if not before.exists():
            continue
        b = json.loads(before.read_text())
        a = json.loads(after.read_text()) if after.exists() else None
        o = json.loads(own.read_text()) if own.exists() else None
        cells = [option, f"{o['perplexity']:.1f}" if o else "–", f"{b['perplexity']:.2f}",
                 f"{b['perplexity'] / parent['perplexity']:.3f}"]
        cells += ([f"{a['perplexity']:.2f}", f"{a['perplexity'] / parent['perplexity']:.3f}", f"{a['kl_div']:.4f}"]
                  if a else ["–", "–", "–"])
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    (work / "report-calibration-default.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=quality.REPO / "runs" / "bench_calibration")
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--gkd-tokens", type=int, default=8192, help="0: the children before GKD only")
    parser.add_argument("--report", action="store_true", help="only print the table from what is done")
    args = parser.parse_args()
    work = args.work.resolve()
    for sub in ("logs", "records", "evals"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    if not args.report:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        quality.evaluate(work, quality.PARENT, "parent")
        for option in args.options.split(","):
            quality.log(f"stage: calibration option {option}")
            text = option_text(work, option)
            quality.cached(work / "evals" / f"parent-on-{option}.json", lambda: quality.run_json(
                ["eval", quality.PARENT, "--data", str(text), "--seq-len", "512"], work / "logs" / f"eval-{option}.log"))
            run_option(work, option, args.gkd_tokens)
            print(report(work, args.gkd_tokens), flush=True)
    print(report(work, args.gkd_tokens))


if __name__ == "__main__":
    main()
