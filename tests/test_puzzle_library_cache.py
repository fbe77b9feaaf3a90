"""The library `mlx search` caches: keyed by what built it (weights, recipe contents, data, seed, dtypes),
reused only for the same inputs, and announced when reused."""

from __future__ import annotations

import pytest

from conftest import TINY_PUZZLE_RECIPE, make_tiny_llama, recording_reporter, save_with_tokenizer
from mlxkit.engines.puzzle.library import build
from mlxkit.engines.puzzle.library.build import default_library_dir, ensure_library




def _dir(model, recipe, **kwargs):
    return default_library_dir(str(model), str(recipe), device="cpu", **kwargs)


def test_another_data_seed_or_weights_is_another_library(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    base = _dir(tiny_llama_dir, tiny_recipe_file, data=text_file, seed=0)
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file, seed=0) == base
    other_text = tmp_path / "other.txt"
    other_text.write_text(text_file.read_text() + "one more line\n")
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=other_text, seed=0) != base
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=None, seed=0) != base
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file, seed=3) != base
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file, seed=0, dtype="bfloat16") != base
    # The same path, other weights: the directory's contents key the library, not its name.
    save_with_tokenizer(make_tiny_llama(seed=5), tiny_llama_dir)
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file, seed=0) != base


def test_a_recipe_file_edited_in_place_is_another_library(tiny_llama_dir, tiny_recipe_file, text_file):
    base = _dir(tiny_llama_dir, tiny_recipe_file, data=text_file)
    assert base.name.endswith("-tiny")
    tiny_recipe_file.write_text(TINY_PUZZLE_RECIPE.replace("lr: 1.0e-3", "lr: 2.0e-3"))
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file) != base
    # Formatting that does not change the validated recipe keeps the key.
    tiny_recipe_file.write_text("# a comment\n" + TINY_PUZZLE_RECIPE)
    assert _dir(tiny_llama_dir, tiny_recipe_file, data=text_file) == base


def test_the_same_inputs_reuse_the_built_library(tiny_llama_dir, tiny_recipe_file, text_file, monkeypatch):
    first = recording_reporter()
    path = ensure_library(str(tiny_llama_dir), str(tiny_recipe_file), data=text_file, seed=0, device="cpu",
                          reporter=first)
    assert (path / "library.json").exists()
    assert any("building" in line for line in first.lines)
    stamp = (path / "library.json").stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("the library was rebuilt")

    monkeypatch.setattr(build, "run_library_build", refuse)
    again = recording_reporter()
    assert ensure_library(str(tiny_llama_dir), str(tiny_recipe_file), data=text_file, seed=0, device="cpu",
                          reporter=again) == path
    assert (path / "library.json").stat().st_mtime_ns == stamp
    [line] = [line for line in again.lines if "reusing" in line]
    assert str(text_file) in line and "seed 0" in line
    with pytest.raises(AssertionError, match="rebuilt"):
        ensure_library(str(tiny_llama_dir), str(tiny_recipe_file), data=text_file, seed=1, device="cpu",
                       reporter=again)
