"""Tokenising --data: the streaming token-shard build against the in-memory `tokenize(read_texts(...))` path.

Corpus: the lines of wikitext-2 (test and validation splits, ../shared/data/wikitext2-*.txt), shuffled
with a seeded generator round after round and written a few thousand lines at a time until the file
holds about the asked number of SmolLM2 tokens (the tokens per character are measured on a sample
first; the build is then cut at exactly --tokens). It is one .txt document, or with --format jsonl one
record per 20 lines. Corpora are kept under --work and reused by later runs.

Each measurement runs in its own process, so its peak RSS (VmHWM) is its own; the baseline is
the RSS after imports and loading the tokenizer, before any text is read. Reported per run: tokens,
wall seconds, tokens/s, peak RSS and the growth over the baseline.

    python bench/bench_tokenize.py [--tokens 1e8] [--old-tokens 1e7] [--format txt|jsonl]
                                   [--work DIR] [--time-limit SECONDS] [--tokenizer DIR] [--shard-tokens N]

Time box: a streaming build still running after --time-limit seconds is stopped and its progress
reported; the build resumes from its last finished shard when the same command runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def write_corpus(path: Path, chars: int, *, seed: int, lines: list[str], fmt: str = "txt",
                 lines_per_record: int = 20) -> int:
    """Write shuffled rounds of `lines` to `path` until at least `chars` characters; returns the count."""
    rng = random.Random(seed)
    written = 0
    order = list(range(len(lines)))
    with open(path, "w", encoding="utf-8") as handle:
        while written < chars:
            rng.shuffle(order)
            for start in range(0, len(order), 4096):  # a bounded chunk of lines per write
                chunk = [lines[i] for i in order[start:start + 4096]]
                if fmt == "jsonl":
                    text = "".join(json.dumps({"text": "".join(chunk[k:k + lines_per_record])}) + "\n"
                                   for k in range(0, len(chunk), lines_per_record))
                else:
                    text = "".join(chunk)
                handle.write(text)
                written += len(text)
                if written >= chars:
                    break
    return written


def _source_lines() -> list[str]:
    files = sorted(SHARED.glob("wikitext2-*.txt"))
    if not files:
        raise SystemExit(f"no wikitext-2 text in {SHARED}")
    lines = [line for f in files for line in f.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()]
    return lines


def _tokenizer_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from mlxkit.engines.models.default_model import default_model_dir

    path = default_model_dir()
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"no tokenizer in {path}: run `mlx fetch smollm2-135m` or pass --tokenizer")
    return path


def _status_mb(field: str) -> float:
    """A /proc/self/status size in MiB: VmRSS now, VmHWM the peak since this process's exec.

    Not ru_maxrss: Linux carries it over from the parent through fork and exec, so a worker would
    report the larger peak of the process that started it.
    """
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    baseline = _status_mb("VmRSS")
    started = time.perf_counter()
    if args.worker == "old":
        from mlxkit.engines.data.text import read_texts, tokenize

        ids = tokenize(tokenizer, read_texts(args.corpus), args.tokens)
        tokens, extra = int(ids.numel()), {}
    else:
        from mlxkit.engines.data.token_shards import build_token_shards

        root = Path(args.root)
        before = 0
        for progress in root.glob("*.partial/progress.json"):  # a resumed build
            before = max(before, json.loads(progress.read_text())["total_tokens"])
        options = {k: v for k, v in (("piece_chars", args.piece_chars), ("batch_chars", args.batch_chars),
                                     ("shard_tokens", args.shard_tokens)) if v}
        shards = build_token_shards(args.corpus, tokenizer, root, max_tokens=args.tokens, **options)
        tokens = len(shards) - before
        extra = {"shards": len(shards.manifest.shards), "resumed_from_tokens": before, "dtype": shards.manifest.dtype,
                 "shard_bytes": sum((shards.path / e.file).stat().st_size for e in shards.manifest.shards)}
    seconds = time.perf_counter() - started
    peak = _status_mb("VmHWM")
    print(json.dumps({"path": args.worker, "tokens": tokens, "seconds": round(seconds, 2),
                      "tokens_per_s": round(tokens / seconds), "peak_rss_mb": round(peak, 1),
                      "baseline_rss_mb": round(baseline, 1), "rss_growth_mb": round(peak - baseline, 1), **extra}))


def _corpus(work: Path, tokens: int, fmt: str, tokenizer_dir: Path) -> Path:
    path = work / f"corpus-{tokens}.{fmt}"
    done = path.with_suffix(path.suffix + ".done")
    if path.exists() and done.exists():
        return path
    from transformers import AutoTokenizer

    lines = _source_lines()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sample = "".join(random.Random(1).sample(lines, min(len(lines), 20_000)))
    per_char = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / len(sample)
    chars = int(tokens / per_char * 1.03) + 10_000  # a margin: the build is cut at exactly `tokens`
    started = time.perf_counter()
    write_corpus(path, chars, seed=0, lines=lines, fmt=fmt)
    done.write_text(json.dumps({"chars": chars, "tokens_per_char": per_char,
                                "seconds": round(time.perf_counter() - started, 1)}))
    return path


def _run(kind: str, corpus: Path, tokens: int, args: argparse.Namespace, root: Path,
         timeout: float | None) -> dict:
    if root.is_dir():  # time a fresh build: drop finished shards, keep a build under way to resume
        for entry in root.iterdir():
            if entry.is_dir() and not entry.name.endswith(".partial"):
                shutil.rmtree(entry)
    command = [sys.executable, __file__, "--worker", kind, "--corpus", str(corpus), "--tokens", str(tokens),
               "--tokenizer", str(args.tokenizer), "--root", str(root)]
    if args.piece_chars:
        command += ["--piece-chars", str(args.piece_chars)]
    if args.batch_chars:
        command += ["--batch-chars", str(args.batch_chars)]
    if args.shard_tokens:
        command += ["--shard-tokens", str(args.shard_tokens)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        progress = [json.loads(p.read_text()) for p in root.glob("*.partial/progress.json")]
        built = max((p["total_tokens"] for p in progress), default=0)
        return {"path": kind, "stopped_after_s": timeout, "tokens_built_so_far": built,
                "note": "time limit reached; run the same command again to resume"}
    if done.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=float, default=1e8, help="streaming build size (tokens)")
    parser.add_argument("--old-tokens", type=float, default=1e7,
                        help="size of the side-by-side run of both paths (0: skip it)")
    parser.add_argument("--format", choices=["txt", "jsonl"], default="txt")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mlxkit-bench-tokenize")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for the large streaming build")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the cached SmolLM2-135M)")
    parser.add_argument("--piece-chars", type=int, default=None)
    parser.add_argument("--batch-chars", type=int, default=None)
    parser.add_argument("--shard-tokens", type=int, default=None,
                        help="tokens a shard (a stopped build keeps its finished shards)")
    parser.add_argument("--worker", choices=["old", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.tokens = int(args.tokens)
        _worker(args)
        return
    args.tokenizer = _tokenizer_dir(args.tokenizer)
    args.work.mkdir(parents=True, exist_ok=True)
    settings = (("p", args.piece_chars), ("b", args.batch_chars), ("s", args.shard_tokens))
    tag = "-".join([args.format] + [f"{name}{value or 'default'}" for name, value in settings])
    results = []
    small = int(args.old_tokens)
    if small:
        corpus = _corpus(args.work, small, args.format, args.tokenizer)
        results.append({"size": small, **_run("old", corpus, small, args, args.work / "unused", None)})
        results.append({"size": small, **_run("stream", corpus, small, args, args.work / f"shards-{tag}-{small}",
                                              None)})
    large = int(args.tokens)
    corpus = _corpus(args.work, large, args.format, args.tokenizer)
    results.append({"size": large, **_run("stream", corpus, large, args, args.work / f"shards-{tag}-{large}",
                                          args.time_limit)})
    for row in results:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
