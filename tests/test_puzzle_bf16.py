"""`mlx library build` in bfloat16: the same library as in float32, within bfloat16's precision, written in bfloat16.

bfloat16 matmuls are slow on a CPU, so the parent is the tiny Llama (hidden 32, 2 layers)
and the recipe the tiny one of conftest (8 BLD steps per block, 2 held-out sequences).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import TINY_PUZZLE_RECIPE, make_char_tokenizer, make_tiny_llama, tiny_layer0_states
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import FFNVariant
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.library.bld import train_subblock
from mlxkit.engines.puzzle.library.build import LibraryBuildOptions, run_library_build
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library
from mlxkit.engines.puzzle.recipe import BLDSpec, load_recipe
from mlxkit.engines.puzzle.subblocks import parent_subblock

# Tolerances, relative to the float32 run. bfloat16 keeps 8 significant bits (rounding error
# 2^-9, 0.2%) in the parent's weights, in every cached activation and in every matmul of the
# forward; the float32 master weights, float32 losses and float32 log-softmax keep those
# errors from compounding. Measured on this library: KL of every replaced subblock within
# 0.8% of float32, held-out NMSE within 0.4%, the parent's LM loss within 0.02%. The bounds
# below leave about 4x room, so a torch upgrade that rounds differently does not trip them.
KL_RTOL = 0.03
NMSE_RTOL = 0.015
LM_LOSS_RTOL = 0.001


def _files(root: Path) -> dict[str, Path]:
    model_dir = root / "tiny-llama"
    make_tiny_llama().save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    recipe = root / "tiny.yaml"
    recipe.write_text(TINY_PUZZLE_RECIPE)
    text = root / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n"
                            for i in range(400)))
    return {"model": model_dir, "recipe": recipe, "data": text}


def _options(files: dict[str, Path], out: Path, **extra) -> LibraryBuildOptions:
    return LibraryBuildOptions(model=str(files["model"]), out=out, recipe=load_recipe(str(files["recipe"])),
                          data=files["data"], device="cpu", keep_activations=True, **extra)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, Path]:
    """The tiny parent's library built twice on the CPU: in float32 and in bfloat16 (same data, same seeds)."""
    root = tmp_path_factory.mktemp("bf16")
    files = _files(root)
    built = {"files": files}
    for dtype in ("float32", "bfloat16"):
        built[dtype] = root / f"lib-{dtype}"
        run_library_build(_options(files, built[dtype], dtype=dtype))
    return built


def _dtypes(path: Path) -> set[torch.dtype]:
    with safe_open(str(path), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_bf16_library_agrees_with_float32(libraries):
    full, half = read_library(libraries["float32"]), read_library(libraries["bfloat16"])
    compared = 0
    for layer32, layer16 in zip(full.layers, half.layers, strict=True):
        for kind in ("attention", "ffn"):
            for name, item32 in layer32.entries(kind).items():
                item16 = layer16.entries(kind)[name]
                assert item16.source == item32.source, (kind, name)
                if item32.source == "parent":  # the parent against itself: KL 0 in either precision
                    assert item16.metrics["kl_div"] == item32.metrics["kl_div"] == 0.0
                    assert item16.metrics["lm_loss"] == pytest.approx(item32.metrics["lm_loss"], rel=LM_LOSS_RTOL)
                    continue
                assert item16.metrics["kl_div"] == pytest.approx(item32.metrics["kl_div"], rel=KL_RTOL), \
                    (layer32.layer, kind, name)
                if item32.training is not None:
                    assert item16.training.steps == item32.training.steps
                    assert item16.training.val_nmse == pytest.approx(item32.training.val_nmse, rel=NMSE_RTOL), \
                        (layer32.layer, kind, name)
                compared += 1
    assert compared == 2 * 2 * 3  # layers x kinds x (two trained or initialised variants and no_op)


def test_bf16_run_caches_trains_and_writes_in_bf16(libraries):
    half = LibraryDir(libraries["bfloat16"])
    key = read_library(half.root).run_key
    assert (key.compute_dtype, key.save_dtype) == ("bfloat16", "bfloat16")
    blocks = sorted(half.blocks.glob("*.safetensors"))
    assert len(blocks) == 8 and all(_dtypes(path) == {torch.bfloat16} for path in blocks)
    assert _dtypes(half.work / "activations" / "layer000.safetensors") == {torch.bfloat16}
    # The float32 run is what it always was: float32 everywhere, and so recorded.
    full = LibraryDir(libraries["float32"])
    key = read_library(full.root).run_key
    assert (key.compute_dtype, key.save_dtype) == ("float32", "float32")
    assert all(_dtypes(path) == {torch.float32} for path in full.blocks.glob("*.safetensors"))


def test_save_dtype_overrides_and_a_directory_keeps_its_precision(libraries, tmp_path):
    files = libraries["files"]
    out = tmp_path / "lib"
    # Initialisation only, no scoring: the cheap way to get blocks written from a bfloat16 run.
    run_library_build(_options(files, out, dtype="bfloat16", save_dtype="float32", train=False, score=False))
    blocks = list(LibraryDir(out).blocks.glob("*.safetensors"))
    assert blocks and all(_dtypes(path) == {torch.float32} for path in blocks)
    with pytest.raises(InputError, match="compute_dtype"):
        run_library_build(_options(files, out, dtype="float32", train=False, score=False))


def test_a_run_key_written_before_the_dtype_fields_resumes_as_float32(libraries, tmp_path):
    out = tmp_path / "lib"
    shutil.copytree(libraries["float32"], out)
    run_json = LibraryDir(out).run_key_file
    key = json.loads(run_json.read_text())
    for field in ("compute_dtype", "save_dtype"):
        del key[field]
    run_json.write_text(json.dumps(key))
    (out / "library.json").unlink()
    run_library_build(_options(libraries["files"], out, dtype="float32"))
    assert read_library(out).run_key.compute_dtype == "float32"


def test_train_subblock_autocasts_the_forward_and_keeps_float32_master_weights():
    from mlxkit.engines.training.device import Placement

    parent, pos, _, mid, out = tiny_layer0_states(6, 16)
    x, y = mid.bfloat16(), out - mid  # states cached in bfloat16, targets taken in float32
    block = initialise(parent_subblock(parent, 0, "ffn"), FFNVariant("mlp", 16), parent.config, 0, x, y,
                       dtype=torch.float32)
    seen = []
    block.layer.mlp.down_proj.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    placement = Placement(torch.device("cpu"), torch.bfloat16, explicit_dtype=True)
    record = train_subblock(block, x, y, x, y, pos, BLDSpec(tokens_per_block=4 * 4 * 16, batch_sequences=4, lr=1e-2),
                            seed=0, placement=placement)
    assert record.steps == 4 and seen and set(seen) == {torch.bfloat16}, "the forward runs under bfloat16 autocast"
    assert all(p.dtype == torch.float32 for p in block.parameters()), "master weights stay float32"
