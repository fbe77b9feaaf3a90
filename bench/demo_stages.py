"""Side-by-side stage table of two `mlx search` runs, read from their logs and outputs (bench_demo_time.sh).

Stage times are the progress lines' "done in" durations (whole seconds, as the log prints them);
the child is compared by its chosen blocks and the held-out KLs its manifest records.

    python bench/demo_stages.py demo-old.log demo-new.log child-old/ child-new/
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# "task: 12/90 done in 1m02s, ..." or, for a task that counts nothing, "task: done in 8s" (older code: "0 done in").
DONE = re.compile(r"^\[[\d:]+\] (?P<task>.+?): (?:(?:\d+/)?[\d.]+ )?done in (?P<duration>\S+?),?(?: |$)")
DURATION = re.compile(r"^(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?$")


def seconds(text: str) -> int:
    match = DURATION.match(text)
    if not match or not any(match.groups()):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(match[unit] or 0) * scale for unit, scale in (("h", 3600), ("m", 60), ("s", 1)))


def stage_times(log: Path) -> dict[str, int]:
    """Task name -> seconds, summed over tasks of the same name (GKD's name carries its size)."""
    times: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = DONE.match(line)
        if match:
            task = re.sub(r"\d[\d,]*", "N", match["task"])
            times[task] = times.get(task, 0) + seconds(match["duration"])
    return times


def child_summary(out: Path) -> dict:
    """The blocks chosen per layer and the held-out KLs the run recorded (its `mlxkit.json`)."""
    record = json.loads((out / "mlxkit.json").read_text())
    results = record.get("results", {})
    evaluation = record.get("settings", {}).get("search", {}).get("child_before_gkd", {}).get("evaluation", {})
    return {"blocks": json.loads((out / "config.json").read_text()).get("block_configs"),
            "held-out KL of the searched child": evaluation.get("kl_div"),
            "held-out KL before GKD": results.get("before", {}).get("kl_div"),
            "held-out KL after GKD": results.get("after", {}).get("kl_div")}


def main() -> None:
    old_log, new_log, old_out, new_out = map(Path, sys.argv[1:5])
    old, new = stage_times(old_log), stage_times(new_log)
    print("| stage | old s | new s | new/old |\n|---|---:|---:|---:|")
    for task in list(dict.fromkeys([*old, *new])):
        a, b = old.get(task), new.get(task)
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        print(f"| {task} | {a if a is not None else '-'} | {b if b is not None else '-'} | {ratio} |")
    old_child, new_child = child_summary(old_out), child_summary(new_out)
    print("same blocks chosen:", old_child.pop("blocks") == new_child.pop("blocks"))
    for key in sorted(set(old_child) | set(new_child)):
        print(f"{key}: old {old_child.get(key)} new {new_child.get(key)}")


if __name__ == "__main__":
    main()
