"""Stage keys: what a stage of work depends on, and the one rule for resuming it.

A stage (a block library, the child a search stages before GKD, a training run) depends on its
inputs and settings. Its key is those as one JSON record; its digest is the sha256 of the record's
canonical form (sorted keys, no whitespace), so a key is computed one way wherever it is used.
The record is written beside the work when the stage starts, and a rerun applies one rule:

- the same key: the work is reused when finished, resumed when not;
- another key: the work is stale, so it is discarded with a notice naming the fields that changed,
  and the stage starts over.

A finished output the user asked for is not stale work: whether it may be replaced is its verb's
decision (--overwrite), not this rule's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from mlxkit.engines.core.atomic import atomic_write_json
from mlxkit.engines.core.progress import Reporter

StageState = Literal["new", "same", "discarded"]


def canonical(value: Any) -> Any:
    """`value` as plain JSON data (pydantic models dumped, paths and other objects as their strings)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.loads(json.dumps(value, default=str))


def digest_of(value: Any, length: int = 16) -> str:
    """The first `length` hex digits of the sha256 of `value`'s canonical JSON."""
    text = json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class StageKey:
    """One stage's key: a flat record of named fields (each any JSON value)."""

    record: dict[str, Any]

    @classmethod
    def of(cls, value: Mapping[str, Any] | BaseModel) -> StageKey:
        record = canonical(value)
        if not isinstance(record, dict):
            raise TypeError(f"a stage key is a record of named fields, not {type(record).__name__}")
        return cls(record)

    @property
    def digest(self) -> str:
        return digest_of(self.record)

    def changed_from(self, previous: Any, exempt: Sequence[str] = ()) -> list[str]:
        """The fields whose values differ from `previous` (every field when `previous` is not a record)."""
        if not isinstance(previous, Mapping):
            return sorted(k for k in self.record if k not in exempt)
        names = set(self.record) | set(previous)
        return sorted(k for k in names if k not in exempt and previous.get(k) != self.record.get(k))


def read_key_record(path: Path, defaults: Mapping[str, Any] | None = None) -> Any:
    """The key record stored at `path`: None when there is none, the raw value when it is not a record
    (a damaged file counts as another key), with `defaults` filling fields an older writer did not know."""
    if not path.is_file():
        return None
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return "unreadable"
    if isinstance(previous, dict) and defaults:
        previous = {**defaults, **previous}
    return previous


def write_key_record(path: Path, key: StageKey) -> None:
    atomic_write_json(path, key.record)


@dataclass
class StageWork:
    """A stage's work directory and the file inside it that holds the key it was started under.

    `open` applies the resume rule. Under several processes every rank calls it: rank 0 alone
    (`is_main`) removes and writes, and `barrier` separates the ranks' read of the old key from the
    removal, and the removal from the work that follows.
    """

    work: Path
    key_file: Path
    what: str = "work"  # names the work in the notice: "an unfinished GKD run", ...
    is_main: bool = True
    barrier: Callable[[], None] = field(default=lambda: None)

    def open(self, key: StageKey, reporter: Reporter | None = None, *, exempt: Sequence[str] = (),
             defaults: Mapping[str, Any] | None = None) -> StageState:
        """'same' when the work was started under `key` (resume or reuse it), 'new' when there was none,
        'discarded' when another key's work was removed; after 'new' and 'discarded' the key is recorded."""
        previous = read_key_record(self.key_file, defaults)
        changed = key.changed_from(previous, exempt) if previous is not None else []
        self.barrier()  # every rank has read the old key before rank 0 removes it
        if previous is not None and not changed:
            return "same"
        # Without a recorded key the directory is not known to be this stage's work: it is kept, and
        # the caller refuses a directory it cannot claim.
        state: StageState = "new" if previous is None else "discarded"
        if self.is_main:
            if state == "discarded":
                shutil.rmtree(self.work)
                if reporter is not None:
                    reporter.notice(f"discarded {self.what} in {self.work} (other settings: {', '.join(changed)}); "
                                    "starting over")
            self.work.mkdir(parents=True, exist_ok=True)
            write_key_record(self.key_file, key)
        self.barrier()
        return state
