"""The stage-key rule: the same key resumes, another discards the stale work with a notice, and a
directory without a recorded key is not this rule's to remove."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import BaseModel

from mlxkit.engines.core.stage_key import StageKey, StageWork, digest_of


class _Notices:
    def __init__(self):
        self.lines: list[str] = []

    def notice(self, message: str) -> None:
        self.lines.append(message)


def test_the_digest_is_the_sha256_of_the_sorted_compact_json():
    record = {"b": [1, 2.5, None], "a": {"y": "é", "x": True}}
    text = '{"a":{"x":true,"y":"é"},"b":[1,2.5,null]}'
    assert digest_of(record) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert StageKey.of(record).digest == StageKey.of(dict(reversed(list(record.items())))).digest


def test_a_model_and_its_dump_give_one_key():
    class Settings(BaseModel):
        lr: float
        steps: int

    assert StageKey.of(Settings(lr=0.1, steps=3)).record == {"lr": 0.1, "steps": 3}
    with pytest.raises(TypeError):
        StageKey.of([1, 2])  # type: ignore[arg-type]


def test_same_key_resumes_and_another_discards_with_the_changed_fields(tmp_path):
    work = tmp_path / "work"
    stage = StageWork(work, work / "run.json", what="an unfinished test run")
    notices = _Notices()
    assert stage.open(StageKey.of({"seed": 0, "lr": 1e-3}), notices) == "new"
    (work / "checkpoint.pt").write_bytes(b"progress")
    assert stage.open(StageKey.of({"lr": 1e-3, "seed": 0}), notices) == "same"
    assert (work / "checkpoint.pt").exists() and notices.lines == []
    assert stage.open(StageKey.of({"seed": 1, "lr": 1e-3, "steps": 9}), notices) == "discarded"
    assert not (work / "checkpoint.pt").exists()
    assert json.loads((work / "run.json").read_text()) == {"seed": 1, "lr": 1e-3, "steps": 9}
    assert notices.lines == [f"discarded an unfinished test run in {work} (other settings: seed, steps); starting over"]


def test_an_unreadable_key_is_another_key(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.json").write_text('{"seed": 0')  # torn
    (work / "stale").write_text("x")
    assert StageWork(work, work / "run.json").open(StageKey.of({"seed": 0})) == "discarded"
    assert not (work / "stale").exists()


def test_a_directory_without_a_key_is_kept(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("not a stage's work")
    assert StageWork(work, work / "run.json").open(StageKey.of({"seed": 0})) == "new"
    assert (work / "mine.txt").read_text() == "not a stage's work"


def test_defaults_fill_fields_an_older_writer_did_not_know(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"seed": 0}))
    key = StageKey.of({"seed": 0, "dtype": "float32"})
    assert StageWork(work, work / "run.json").open(key, defaults={"dtype": "float32"}) == "same"
    assert StageWork(work, work / "run.json").open(key, defaults={"dtype": "bfloat16"}) == "discarded"


def test_exempt_fields_do_not_count(tmp_path):
    work = tmp_path / "work"
    stage = StageWork(work, work / "run.json")
    stage.open(StageKey.of({"seed": 0, "train": True}))
    assert stage.open(StageKey.of({"seed": 0, "train": False}), exempt=("train",)) == "same"
