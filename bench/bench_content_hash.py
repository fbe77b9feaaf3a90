"""Hashing an input for the manifest and the run keys: the first hash of a path against the memoised ones.

`content_hash` reads every byte of a model or corpus once, then remembers the digest under the
files' stat records. This hashes PATH in a fresh, empty cache, then again three times, and
reports the seconds of each, the read rate of the first, and the ratio.

    python bench/bench_content_hash.py ~/.cache/mlxkit/models/smollm2-135m

Run it alone on the machine, twice: the first run may also be reading the files from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MLXKIT_CACHE"] = cache
        from mlxkit.engines.core.manifest import content_hash

        files = [args.path] if args.path.is_file() else [p for p in args.path.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        times, digests = [], set()
        for _ in range(4):
            started = time.perf_counter()
            digests.add(content_hash(args.path))
            times.append(time.perf_counter() - started)
    warm = sorted(times[1:])[1]
    print(json.dumps({"bytes": size, "first_s": round(times[0], 3), "first_mb_per_s": round(size / times[0] / 1e6),
                      "memoised_s_median": round(warm, 4), "memoised_vs_first": round(warm / times[0], 4),
                      "same_digest": len(digests) == 1}, indent=1))


if __name__ == "__main__":
    main()
