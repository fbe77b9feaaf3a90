"""Curated bad and edge inputs for every verb, run through the CLI.

Each case must end in a non-zero exit code, exactly one `error:` line, no traceback, and no
output or temporary file left behind; the inputs are byte-identical afterwards. A sample is rerun
with `--json` and must print one parseable `{"error": {...}}` object on stdout. RELIABILITY.md
lists every case and its outcome.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from conftest import TINY_PUZZLE_RECIPE, library_workspace, make_char_tokenizer, make_tiny_llama
from mlxkit.cli.main import app

runner = CliRunner()


# ---------------------------------------------------------------------------------------------
# A module-wide workspace: one tiny model, one corpus, one built library; each case copies what it breaks.


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reliability")
    model = root / "tiny"
    make_tiny_llama().save_pretrained(model)
    make_char_tokenizer().save_pretrained(model)
    built = library_workspace(root, model)
    wide = root / "wide"  # same vocabulary, a different hidden size
    make_tiny_llama(hidden_size=48, num_attention_heads=4, num_key_value_heads=2).save_pretrained(wide)
    make_char_tokenizer().save_pretrained(wide)
    return {"root": root, "model": model, **built, "wide": wide}


def _copy_model(ws, name: str) -> Path:
    out = ws["case"] / name
    shutil.copytree(ws["model"], out)
    return out


def _rewrite_header(path: Path, edit=None, raw: bytes | None = None) -> None:
    """Rewrite a safetensors header in place: `edit(header)` mutates the parsed JSON, or `raw` replaces it."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + length]), blob[8 + length:]
    if raw is None:
        edit(header)
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def _model_with(ws, how: str) -> Path:
    """A copy of the tiny model, broken in one way."""
    out = _copy_model(ws, f"model-{how}")
    weights = out / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "dtype-span":
        _rewrite_header(weights, lambda h: _first_tensor(h).update(dtype="F16"))
    elif how == "negative-count":
        _rewrite_header(weights, lambda h: _first_tensor(h).update(shape=[-1, 32]))
    elif how == "unknown-dtype":
        _rewrite_header(weights, lambda h: _first_tensor(h).update(dtype="F33"))
    elif how == "non-utf8":
        _rewrite_header(weights, raw=b'{"\xff\xfe": 1}')
    elif how == "non-string-key":
        _rewrite_header(weights, raw=b'{1: {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}')
    elif how in ("nan", "one-nan"):
        tensors = load_file(weights)
        name = "model.layers.0.mlp.down_proj.weight"
        if how == "nan":
            tensors[name] = torch.full_like(tensors[name], float("nan"))
        else:
            tensors[name][0, 0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "bad-config":
        (out / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    else:
        raise AssertionError(how)
    return out


def _config(ws, name: str, **changes) -> Path:
    config = json.loads((ws["model"] / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    path = ws["case"] / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


_DROP = object()


def _library(ws, name: str, edit) -> Path:
    """A copy of the built library with library.json edited."""
    out = ws["case"] / name
    shutil.copytree(ws["lib"], out)
    data = json.loads((out / "library.json").read_text())
    edit(data)
    (out / "library.json").write_text(json.dumps(data))
    return out


def _nvlabs(ws, name: str, edit) -> Path:
    source = Path(__file__).parent / "fixtures" / "nvlabs_library_small.json"
    data = json.loads(source.read_text())
    edit(data)
    path = ws["case"] / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _gguf(ws, name: str, keep_fraction: float) -> Path:
    """The tiny model as GGUF, cut to `keep_fraction` of its bytes."""
    from test_models_io import write_tiny_gguf

    path = ws["case"] / f"{name}.gguf"
    write_tiny_gguf(make_tiny_llama(), make_char_tokenizer(), path)
    blob = path.read_bytes()
    path.write_bytes(blob[:int(len(blob) * keep_fraction)])
    return path


def _set_first_block(data: dict, section: str, key: str, value) -> None:
    first = next(iter(data["layer_0"].values()))
    first[section][key] = value


def _npz_grid(ws) -> Path:
    import scipy.sparse as sp

    path = ws["case"] / "lap.npz"
    n = 4
    lap = sp.diags([4.0] * (n * n)) - sp.eye(n * n, k=1) - sp.eye(n * n, k=-1)
    matrix = lap.tocsr()
    np.savez(path, data=matrix.data, indices=matrix.indices, indptr=matrix.indptr, format=b"csr",
             shape=np.array(matrix.shape), b=np.ones(n * n))
    return path


def _write(ws, name: str, text: str) -> Path:
    path = ws["case"] / name
    path.write_text(text)
    return path


def _text_as(ws, name: str) -> Path:
    path = ws["case"] / name
    path.write_text("this is plain text, not an archive\n")
    return path


def _existing_file(ws) -> Path:
    path = ws["case"] / "taken"
    path.write_text("an existing file\n")
    return path


def _under_file(ws, name: str) -> str:
    """An output path whose parent is an ordinary file."""
    return str(_existing_file(ws) / name)


def _jsonl(ws, name: str, value) -> Path:
    path = ws["case"] / name
    path.write_text("".join(json.dumps({"text": v}) + "\n" for v in ["a fine line of text", value]))
    return path


def _held_lock(ws, host: str | None = None) -> None:
    """A lock on the case's output (`{out}`), held by this very process, or by a process on another node."""
    from mlxkit.engines.core.owner import Owner

    me = Owner.current()
    owner = me.to_dict() if host is None else {"host": host, "pid": 4242, "started": 1, "boot": "elsewhere"}
    (ws["case"].parent / ".out.lock").write_text(json.dumps(owner))


def _locked(ws, host: str | None = None) -> list[str]:
    _held_lock(ws, host)
    return ["export", str(ws["model"]), "--format", "hf", "--out", OUT]


def _crt(ws, hidden: int, data: Path | None = None) -> list[str]:
    """`finetune --recipe crt` on a 4x4 image classifier with one hidden layer of `hidden` units."""
    config = _write(ws, "clf.json", json.dumps({"architecture": "mlp", "input_shape": [1, 4, 4], "num_classes": 3,
                                                 "hidden": [hidden]}))
    if data is None:
        data = ws["case"] / "train.npz"
        np.savez(data, x=np.full((40, 1, 4, 4), 0.5, dtype=np.float32), y=np.arange(40) % 3)
    return ["finetune", "--recipe", "crt", "--model", str(config), "--data", str(data), "--attacks", "linf",
            "--out", OUT]


def _student_kd(ws, extra):
    return ["--teacher", str(ws["model"]), "--student", str(ws["model"]), "--data", str(ws["text"]),
            "--tokens", "256", *extra]


M, T, OUT = "{model}", "{text}", "{out}"

# (id, args builder, words the error line must contain (case-insensitive), words it must not contain)
CASES = [
    # ---- eval
    ("eval-truncated", lambda w: ["eval", str(_model_with(w, "truncated")), "--data", str(w["text"])], ["truncated"], []),
    ("eval-dtype-span", lambda w: ["eval", str(_model_with(w, "dtype-span"))], ["needs"], []),
    ("eval-negative-count", lambda w: ["eval", str(_model_with(w, "negative-count"))], ["shape"], []),
    ("eval-unknown-dtype", lambda w: ["eval", str(_model_with(w, "unknown-dtype"))], ["unknown dtype"], []),
    ("eval-non-utf8-header", lambda w: ["eval", str(_model_with(w, "non-utf8"))], ["utf-8"], []),
    ("eval-non-string-key", lambda w: ["eval", str(_model_with(w, "non-string-key"))], ["json"], []),
    ("eval-nan-weights", lambda w: ["eval", str(_model_with(w, "nan")), "--data", str(w["text"]),
                                    "--max-tokens", "64", "--seq-len", "32"], ["not finite"], []),
    ("eval-bad-config", lambda w: ["eval", str(_model_with(w, "bad-config"))], ["config.json"], []),
    ("eval-hub-offline", lambda w: ["eval", "m/nonexistent"], ["m/nonexistent"], []),
    ("eval-missing-data", lambda w: ["eval", str(w["model"]), "--data", str(w["case"] / "missing.txt")],
     ["missing.txt"], []),
    # ---- fetch
    ("fetch-truncated", lambda w: ["fetch", str(_model_with(w, "truncated"))], ["truncated"], ["ready"]),
    ("fetch-hub-offline", lambda w: ["fetch", "m/nonexistent"], ["m/nonexistent"], []),
    ("fetch-missing-gguf", lambda w: ["fetch", str(w["case"] / "nowhere.gguf")], ["nowhere.gguf"], []),
    ("fetch-text-as-gguf", lambda w: ["fetch", str(_text_as(w, "fake.gguf"))], ["fake.gguf"], []),
    ("eval-gguf-cut-in-metadata", lambda w: ["eval", str(_gguf(w, "meta", 0.02)), "--data", str(w["text"])],
     ["truncated or corrupt"], []),
    ("eval-gguf-cut-in-tensors", lambda w: ["eval", str(_gguf(w, "data", 0.9)), "--data", str(w["text"])],
     ["truncated or corrupt"], []),
    # ---- recipes
    ("recipes-extra-arg", lambda w: ["recipes", "nosuch"], [], []),
    # ---- distill --bld
    ("bld-truncated", lambda w: ["library", "build", "--model", str(_model_with(w, "truncated")), "--recipe",
                                 str(w["recipe"]), "--data", str(w["text"]), "--out", OUT], ["truncated"], []),
    ("bld-one-nan-weight", lambda w: ["library", "build", "--model", str(_model_with(w, "one-nan")), "--recipe",
                                      str(w["recipe"]), "--data", str(w["text"]), "--out", OUT], ["nan or infinite"], []),
    ("bld-missing-data", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe", str(w["recipe"]),
                                    "--data", str(w["case"] / "missing.txt"), "--out", OUT], ["missing.txt"], []),
    ("bld-bad-recipe-yaml", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe",
                                       str(_write(w, "bad.yaml", "a: [1,\n")),
                                       "--data", str(w["text"]), "--out", OUT], ["bad.yaml"], []),
    ("bld-recipe-unknown-field", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe",
                                            str(_write(w, "x.yaml", TINY_PUZZLE_RECIPE + "bogus: 1\n")),
                                            "--data", str(w["text"]), "--out", OUT], ["bogus"], []),
    ("bld-out-existing-file", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe",
                                         str(w["recipe"]), "--data", str(w["text"]), "--out", str(_existing_file(w))],
     ["taken"], []),
    ("bld-no-mode", lambda w: ["distill", "--model", str(w["model"]), "--out", OUT], [], []),
    # ---- distill --gkd / --kd
    ("gkd-out-existing-file", lambda w: ["distill", "--gkd", *_student_kd(w, ["--out", str(_existing_file(w))])],
     ["taken"], []),
    ("kd-out-existing-file", lambda w: ["distill", "--kd", *_student_kd(w, ["--out", str(_existing_file(w))])],
     ["taken"], []),
    ("kd-wider-student", lambda w: ["distill", "--kd", "--teacher", str(w["model"]), "--student", str(w["wide"]),
                                    "--data", str(w["text"]), "--tokens", "256", "--out", OUT], [], []),
    ("gkd-wider-student", lambda w: ["distill", "--gkd", "--teacher", str(w["model"]), "--student", str(w["wide"]),
                                     "--data", str(w["text"]), "--tokens", "256", "--out", OUT], ["hidden"],
     ["vocab"]),
    ("kd-truncated-teacher", lambda w: ["distill", "--kd", "--teacher", str(_model_with(w, "truncated")),
                                        "--student", str(w["model"]), "--data", str(w["text"]), "--tokens", "256",
                                        "--out", OUT], ["truncated"], []),
    ("kd-bad-set", lambda w: ["distill", "--kd", *_student_kd(w, ["--set", "no.such.field=1", "--out", OUT])],
     ["no.such.field"], []),
    ("kd-set-nan-lr", lambda w: ["distill", "--kd", *_student_kd(w, ["--set", "optim.lr=nan", "--out", OUT])],
     ["lr"], []),
    # ---- search
    ("costs-zero-heads", lambda w: ["search", "--costs-only", "--model", str(_config(w, "c0", num_attention_heads=0)),
                                    "--target", "h100"], ["num_attention_heads"], []),
    ("costs-text-hidden", lambda w: ["search", "--costs-only", "--model", str(_config(w, "c1", hidden_size="big")),
                                     "--target", "h100"], ["hidden_size"], []),
    ("costs-heads-not-dividing", lambda w: ["search", "--costs-only", "--model",
                                            str(_config(w, "c2", num_attention_heads=5)), "--target", "h100"],
     ["divisible"], []),
    ("costs-missing-hidden", lambda w: ["search", "--costs-only", "--model", str(_config(w, "c3", hidden_size=_DROP)),
                                        "--target", "h100"], ["hidden_size"], []),
    ("costs-kv-not-dividing", lambda w: ["search", "--costs-only", "--model",
                                         str(_config(w, "c4", num_key_value_heads=3)), "--target", "h100"], [], []),
    ("costs-not-json", lambda w: ["search", "--costs-only", "--model", str(_text_as(w, "config.json")),
                                  "--target", "h100"], ["config.json"], []),
    ("library-no-layers", lambda w: ["search", "--library", str(_library(w, "l0", lambda d: d.pop("layers"))),
                                     "--target", "cpu", "--dry-run"], ["layers"], []),
    ("library-layer-no-ffn", lambda w: ["search", "--library", str(_library(w, "l1", lambda d: d["layers"][0].pop("ffn"))),
                                        "--target", "cpu", "--dry-run"], ["ffn"], []),
    ("library-unknown-version", lambda w: ["search", "--library", str(_library(w, "l2", lambda d: d.update(version=99))),
                                           "--target", "cpu", "--dry-run"], ["version"], []),
    ("library-nan-score", lambda w: ["search", "--library", str(_library(
        w, "l3", lambda d: d["layers"][0]["ffn"]["ffn32"]["metrics"].update(kl_div=float("nan")))),
        "--target", "cpu", "--dry-run"], [], []),
    ("nvlabs-negative-runtime", lambda w: ["search", "--library", str(_nvlabs(
        w, "n0", lambda d: _set_first_block(d, "stats", "runtime_ms", -5.0))), "--costs", "library",
        "--throughput", "1.2x", "--dry-run"], [], []),
    ("nvlabs-nan-score", lambda w: ["search", "--library", str(_nvlabs(
        w, "n1", lambda d: _set_first_block(d, "metrics", "kl_div", float("nan")))), "--costs", "library",
        "--throughput", "1.2x", "--dry-run"], [], []),
    ("nvlabs-kv-heads-list", lambda w: ["search", "--library", str(_nvlabs(
        w, "n2", lambda d: _set_first_block(d, "stats", "num_kv_heads", [8]))), "--costs", "library",
        "--throughput", "1.2x", "--dry-run"], ["num_kv_heads"], []),
    ("library-with-recipe", lambda w: ["search", "--library", str(w["lib"]), "--recipe", "standard",
                                       "--target", "cpu", "--dry-run"], ["--recipe"], []),
    ("search-bad-throughput", lambda w: ["search", "--target", "cpu", "--library", str(w["lib"]),
                                         "--throughput", "fast", "--dry-run"], ["throughput"], []),
    ("search-bad-memory", lambda w: ["search", "--target", "cpu", "--library", str(w["lib"]),
                                     "--memory", "12XB", "--dry-run"], ["XB"], []),
    ("search-bad-scenario", lambda w: ["search", "--target", "cpu", "--library", str(w["lib"]),
                                       "--scenario", "batch=abc", "--dry-run"], ["batch"], []),
    ("search-unknown-target", lambda w: ["search", "--target", "tpu9", "--library", str(w["lib"]), "--dry-run"],
     ["tpu9"], []),
    ("search-throughput-nan", lambda w: ["search", "--target", "cpu", "--library", str(w["lib"]),
                                         "--throughput", "nanx", "--dry-run"], [], []),
    # ---- calibrate
    ("calibrate-seq-too-long", lambda w: ["calibrate", "--model", str(w["model"]), "--seq", "100000", "--out", OUT + ".yaml"],
     ["256"], []),
    ("calibrate-clock-sundial", lambda w: ["calibrate", "--model", str(w["model"]), "--clock", "sundial",
                                           "--out", OUT + ".yaml"], ["sundial"], ["threads"]),
    ("calibrate-truncated", lambda w: ["calibrate", "--model", str(_model_with(w, "truncated")), "--out", OUT + ".yaml"],
     ["truncated"], []),
    ("calibrate-bad-batch", lambda w: ["calibrate", "--model", str(w["model"]), "--batch", "abc", "--out", OUT + ".yaml"],
     ["abc"], []),
    ("calibrate-bad-dtype", lambda w: ["calibrate", "--model", str(w["model"]), "--dtype", "float8", "--out", OUT + ".yaml"],
     ["float8"], []),
    ("calibrate-dtype-span", lambda w: ["calibrate", "--model", str(_model_with(w, "dtype-span")), "--out", OUT + ".yaml"],
     [], []),
    # ---- merge
    *[(f"merge-density-{v}", (lambda v: lambda w: ["merge", "--method", "ties", str(w["model"]), str(w["model"]),
                                                    "--base", str(w["model"]), "--param", f"density={v}", "-o", OUT])(v),
       ["density"], []) for v in ("nan", "abc", "-1", "2")],
    ("merge-weight-abc", lambda w: ["merge", "--method", "linear", str(w["model"]), str(w["model"]),
                                    "--param", "weight=abc", "-o", OUT], ["weight"], []),
    ("merge-alpha-nan", lambda w: ["merge", "--method", "task-arithmetic", str(w["model"]), "--base", str(w["model"]),
                                   "--alpha", "nan", "-o", OUT], ["alpha"], []),
    ("merge-alpha-huge", lambda w: ["merge", "--method", "task-arithmetic", str(w["model"]), "--base", str(w["model"]),
                                    "--alpha", "1e308", "-o", OUT], ["alpha"], []),
    ("merge-base-bad-config", lambda w: ["merge", "--isotropic", str(w["model"]), str(_copy_model(w, "ft-b")),
                                         "--base", str(_model_with(w, "bad-config")), "-o", OUT], ["config.json"], []),
    ("merge-truncated-model", lambda w: ["merge", "--method", "task-arithmetic", str(_model_with(w, "truncated")),
                                         "--base", str(w["model"]), "-o", OUT], ["truncated"], []),
    ("merge-nan-model", lambda w: ["merge", "--method", "task-arithmetic", str(_model_with(w, "nan")),
                                   "--base", str(w["model"]), "-o", OUT], ["nan or infinite"], []),
    ("merge-bad-shard-size", lambda w: ["merge", "--method", "task-arithmetic", str(w["model"]), "--base",
                                        str(w["model"]), "--max-shard-size", "lots", "-o", OUT], ["lots"], []),
    ("merge-unknown-method", lambda w: ["merge", "--method", "nosuch", str(w["model"]), "--base", str(w["model"]),
                                        "-o", OUT], ["nosuch"], []),
    ("merge-wider-model", lambda w: ["merge", "--method", "task-arithmetic", str(w["wide"]), "--base",
                                     str(w["model"]), "-o", OUT], [], []),
    # ---- solve
    ("solve-text-as-npz", lambda w: ["solve", str(_text_as(w, "sys.npz")), "--out", OUT + ".npz"], ["zip"], []),
    ("solve-grid-overflow", lambda w: ["solve", str(_npz_grid(w)), "--grid", "99999999999x99999999999",
                                       "--out", OUT + ".npz"], ["grid"], []),
    ("solve-grid-abc", lambda w: ["solve", str(_npz_grid(w)), "--grid", "abc", "--out", OUT + ".npz"], ["abc"], []),
    ("solve-grid-mismatch", lambda w: ["solve", str(_npz_grid(w)), "--grid", "3x3", "--out", OUT + ".npz"], [], []),
    ("solve-missing-file", lambda w: ["solve", str(w["case"] / "none.npz")], ["none.npz"], []),
    ("solve-bad-method", lambda w: ["solve", str(_npz_grid(w)), "--method", "magic"], ["magic"], []),
    # ---- finetune
    ("finetune-missing-data", lambda w: ["finetune", "--model", str(w["model"]), "--data",
                                         str(w["case"] / "missing.txt"), "--out", OUT], ["missing.txt"], []),
    ("finetune-steps-zero", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                       "--steps", "0", "--out", OUT], ["steps"], []),
    ("finetune-lr-nan", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                   "--lr", "nan", "--out", OUT], ["lr"], []),
    ("finetune-truncated", lambda w: ["finetune", "--model", str(_model_with(w, "truncated")), "--data",
                                      str(w["text"]), "--out", OUT], ["truncated"], []),
    ("finetune-bad-objective", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                          "--objective", "poetry", "--out", OUT], ["objective"], []),
    ("finetune-out-existing-file", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                              "--steps", "1", "--out", str(_existing_file(w))], ["taken"], []),
    ("finetune-unknown-recipe", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                           "--recipe", "nosuch", "--out", OUT], ["nosuch"], []),
    ("finetune-recipe-climbs-out", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                              "--recipe", "../puzzle/quick", "--out", OUT], ["does not exist"], []),
    # ---- output paths, checked before any work: a parent that is a file (every verb that writes)
    ("export-gguf-parent-is-file", lambda w: ["export", str(w["model"]), "--format", "gguf",
                                              "--out", _under_file(w, "x.gguf")], ["taken", "not a directory"], []),
    ("export-hf-parent-is-file", lambda w: ["export", str(w["model"]), "--format", "hf",
                                            "--out", _under_file(w, "x")], ["taken", "not a directory"], []),
    ("merge-parent-is-file", lambda w: ["merge", "--method", "ties", str(w["model"]), str(_copy_model(w, "ft")),
                                        "--base", str(w["model"]), "-o", _under_file(w, "merged")],
     ["taken", "not a directory"], []),
    ("solve-parent-is-file", lambda w: ["solve", str(_npz_grid(w)), "--out", _under_file(w, "x.npz")],
     ["taken", "not a directory"], []),
    ("finetune-parent-is-file", lambda w: ["finetune", "--recipe", "lora", "--model", str(w["model"]), "--data",
                                           str(w["text"]), "--steps", "2", "--out", _under_file(w, "ad")],
     ["taken", "not a directory"], []),
    ("kd-parent-is-file", lambda w: ["distill", "--kd", *_student_kd(w, ["--out", _under_file(w, "kd")])],
     ["taken", "not a directory"], []),
    ("gkd-parent-is-file", lambda w: ["distill", "--gkd", *_student_kd(w, ["--out", _under_file(w, "gkd")])],
     ["taken", "not a directory"], []),
    ("bld-parent-is-file", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe", str(w["recipe"]),
                                      "--data", str(w["text"]), "--out", _under_file(w, "lib")],
     ["taken", "not a directory"], []),
    ("calibrate-parent-is-file", lambda w: ["calibrate", "--model", str(w["model"]), "--out",
                                            _under_file(w, "p.yaml")], ["taken", "not a directory"], []),
    ("search-parent-is-file", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu", "--model",
                                         str(w["model"]), "--out", _under_file(w, "child")],
     ["taken", "not a directory"], []),
    # ---- an output that is an input, or would hold one: refused even with --overwrite
    ("export-out-is-input", lambda w: ["export", str(_copy_model(w, "m")), "--format", "hf",
                                       "--out", str(w["case"] / "m"), "--overwrite"], ["is the input"], []),
    ("export-out-holds-input", lambda w: ["export", str(_copy_model(w, "m")), "--format", "hf",
                                          "--out", str(w["case"]), "--overwrite"], ["holds the input"], []),
    ("finetune-full-out-is-model", lambda w: ["finetune", "--recipe", "full", "--model", str(_copy_model(w, "m")),
                                              "--data", str(w["text"]), "--steps", "1", "--out", str(w["case"] / "m"),
                                              "--overwrite"], ["is the input"], []),
    ("solve-out-is-input", lambda w: ["solve", str(_npz_grid(w)), "--out", str(w["case"] / "lap.npz"),
                                      "--overwrite"], ["is the input"], []),
    ("finetune-out-file-overwrite", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                               "--steps", "1", "--out", str(_existing_file(w)), "--overwrite"],
     ["taken", "not a directory"], []),
    # ---- an output another run holds
    ("export-locked-here", lambda w: _locked(w), ["in use", "pid"], []),
    ("export-locked-elsewhere", lambda w: _locked(w, "node-elsewhere-1"), ["another node", "node-elsewhere-1",
                                                                           ".out.lock"], []),
    # ---- answers that were wrong but exited 0 (the demo library prices its all-no_op block at zero)
    ("nvlabs-all-no-op", lambda w: ["search", "--library", str(_nvlabs(w, "n3", lambda d: None)), "--costs", "library",
                                    "--throughput", "100x", "--dry-run"], ["at least one"], []),
    ("eval-jsonl-number", lambda w: ["eval", str(w["model"]), "--data", str(_jsonl(w, "n.jsonl", 123))],
     ["n.jsonl:2", "int", "not a string"], []),
    ("eval-jsonl-null", lambda w: ["eval", str(w["model"]), "--data", str(_jsonl(w, "z.jsonl", None))],
     ["z.jsonl:2", "null"], []),
    ("finetune-jsonl-null", lambda w: ["finetune", "--model", str(w["model"]), "--data",
                                       str(_jsonl(w, "z.jsonl", None)), "--out", OUT], ["z.jsonl:2", "null"], []),
    ("search-encoding-alone", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu",
                                             "--encoding", "f16", "--dry-run"], ["--export"], []),
    ("search-scenario-twice", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu",
                                         "--scenario", "batch=1,batch=2", "--dry-run"], ["batch", "twice"], []),
    ("finetune-steps-and-set", lambda w: ["finetune", "--model", str(w["model"]), "--data", str(w["text"]),
                                          "--steps", "2", "--set", "schedule.steps=5", "--out", OUT],
     ["--steps", "schedule.steps"], []),
    ("kd-tokens-and-set", lambda w: ["distill", "--kd", *_student_kd(w, ["--set", "schedule.tokens=512",
                                                                         "--out", OUT])],
     ["--tokens", "schedule.tokens"], []),
    ("crt-text-as-npz", lambda w: _crt(w, 16, _text_as(w, "fake.npz")), ["fake.npz", "zip"], ["pickle"]),
    # ---- resource bounds, before any allocation
    ("crt-hidden-billion", lambda w: _crt(w, 1_000_000_000), ["parameters", "needs at least", "this machine"], []),
    ("gkd-micro-batch-beyond-memory", lambda w: ["distill", "--gkd", *_student_kd(w, [
        "--set", "data.seq_len=256", "--set", "optim.batch_sequences=4000000",
        "--set", "optim.micro_batch_sequences=4000000", "--out", OUT])], ["GKD", "needs at least", "this machine"], []),
    ("bld-score-sequences-beyond-memory", lambda w: ["library", "build", "--model", str(w["model"]), "--recipe",
                                                     str(_write(w, "huge.yaml", TINY_PUZZLE_RECIPE.replace(
                                                         "score_sequences: 2", "score_sequences: 400000000"))),
                                                     "--data", str(w["text"]), "--out", OUT],
     ["block library", "needs at least", "this machine"], []),
    ("eval-seq-len-beyond", lambda w: ["eval", str(w["model"]), "--data", str(w["text"]), "--seq-len", "2048"],
     ["2048", "256"], []),
]

# Cases rerun with --json: the error must also be one parseable object on stdout.
JSON_SAMPLE = {"eval-truncated", "eval-nan-weights", "fetch-truncated", "bld-missing-data", "gkd-out-existing-file",
               "costs-missing-hidden", "library-no-layers", "calibrate-seq-too-long", "merge-density-nan",
               "solve-text-as-npz", "finetune-lr-nan", "export-gguf-parent-is-file", "merge-parent-is-file",
               "solve-parent-is-file", "finetune-parent-is-file", "kd-parent-is-file", "export-out-is-input",
               "export-locked-here", "nvlabs-all-no-op", "eval-jsonl-null", "finetune-steps-and-set"}


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def _snapshot(root: Path) -> dict[Path, str]:
    """Every path under `root` with its content's hash (directories as "dir"): inputs must stay byte-identical."""
    return {p: "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")}


def _run_case(ws, tmp_path, build, extra=()):
    case = tmp_path / "case"
    case.mkdir(exist_ok=True)
    ws = dict(ws, case=case)
    out = tmp_path / "out"
    args = [a.replace(OUT, str(out)) if a.startswith(OUT) else a for a in build(ws)]
    before = _snapshot(case)
    result = runner.invoke(app, [*args, *extra])
    return result, out, case, before


@pytest.mark.parametrize("name,build,must,must_not", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(ws, tmp_path, name, build, must, must_not):
    result, out, case, before = _run_case(ws, tmp_path, build)
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    message = lines[0].lower()
    for word in must:
        assert word.lower() in message, lines[0]
    for word in must_not:
        assert word.lower() not in message, lines[0]
    assert ".tmp-" not in message, lines[0]  # never name an internal temporary
    assert not list(tmp_path.glob("out*"))
    assert not _temporaries(tmp_path) and not _temporaries(ws["root"])
    assert _snapshot(case) == before  # nothing written beside the inputs, and the inputs unchanged


@pytest.mark.parametrize("name,build", [(c[0], c[1]) for c in CASES if c[0] in JSON_SAMPLE],
                         ids=[c[0] for c in CASES if c[0] in JSON_SAMPLE])
def test_bad_input_with_json_is_one_error_object(ws, tmp_path, name, build):
    result, out, _, _ = _run_case(ws, tmp_path, build, extra=["--json"])
    assert result.exit_code != 0
    payload = json.loads(result.stdout)
    assert set(payload) == {"error"} and payload["error"]["exit_code"] == result.exit_code
    assert payload["error"]["message"] and "Traceback" not in result.output
    assert not list(tmp_path.glob("out*"))


def test_bld_missing_data_leaves_no_run_file(ws, tmp_path):
    out = tmp_path / "lib"
    result = runner.invoke(app, ["library", "build", "--model", str(ws["model"]), "--recipe", str(ws["recipe"]),
                                 "--data", str(tmp_path / "missing.txt"), "--out", str(out)])
    assert result.exit_code != 0
    assert not (out / ".work" / "run.json").exists() and not out.exists()


def test_directories_named_like_packaged_recipes_do_not_hide_them(ws, tmp_path, monkeypatch):
    """From a folder holding a directory of every packaged recipe and profile name, each name still loads."""
    from mlxkit.engines.distill.recipe import available_recipes as distill_names, load_distill_recipe
    from mlxkit.engines.finetune.recipe import available_recipes as finetune_names, load_finetune_recipe
    from mlxkit.engines.hardware.profile import available_profiles, load_profile
    from mlxkit.engines.merge.config import read_recipe
    from mlxkit.engines.puzzle.recipe import available_recipes as puzzle_names, load_recipe

    merge_names = ["iso-cts-example", "ties-example"]
    loaders = [(distill_names(), load_distill_recipe), (finetune_names(), load_finetune_recipe),
               (puzzle_names(), load_recipe), (available_profiles(), load_profile), (merge_names, read_recipe)]
    for names, _ in loaders:
        for name in names:
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "model.safetensors").write_bytes(b"an earlier run's output")
    monkeypatch.chdir(tmp_path)
    for names, load in loaders:
        assert names
        for name in names:
            assert load(name)
    config = _config(dict(ws, case=tmp_path), "cfg")
    result = runner.invoke(app, ["search", "--costs-only", "--model", str(config), "--target", "cpu",
                                 "--recipe", "quick", "--json"])
    assert result.exit_code == 0, result.output


def test_a_cache_that_cannot_be_created_names_mlxkit_cache(ws, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.delenv("MLXKIT_CACHE")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    result = runner.invoke(app, ["eval", str(ws["model"]), "--max-tokens", "64", "--seq-len", "32"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "MLXKIT_CACHE" in lines[0], result.output


def test_a_leftover_run_with_other_settings_is_discarded_with_a_notice(ws, tmp_path):
    out = tmp_path / "ad"
    work = tmp_path / ".ad.finetune-work"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"steps": 999, "seed": 5}))
    (work / "stale.pt").write_bytes(b"left by the other run")
    args = ["finetune", "--recipe", "lora", "--model", str(ws["model"]), "--data", str(ws["text"]), "--steps", "2",
            "--set", "data.seq_len=32", "--out", str(out)]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    notices = [line for line in done.stderr.splitlines() if "discarded an unfinished fine-tuning run" in line]
    assert len(notices) == 1 and "other settings: " in notices[0] and "steps" in notices[0], done.stderr
    assert (out / "adapter_model.safetensors").is_file() and not work.exists()


@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_every_saved_file_is_0644_under_a_private_umask(ws, tmp_path, recipe):
    out = tmp_path / "ft"
    old = os.umask(0o077)
    try:
        result = runner.invoke(app, ["finetune", "--recipe", recipe, "--model", str(ws["model"]), "--data",
                                     str(ws["text"]), "--steps", "1", "--set", "data.seq_len=32", "--out", str(out),
                                     "--quiet"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_a_batch_far_larger_than_the_data_is_announced(ws, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("a short text, a few sequences at most.\n" * 8)
    result = runner.invoke(app, ["finetune", "--recipe", "lora", "--model", str(ws["model"]), "--data", str(small),
                                 "--batch", "512", "--steps", "1", "--set", "data.seq_len=32", "--set",
                                 "data.held_out_sequences=1", "--out", str(tmp_path / "ad")])
    assert result.exit_code == 0, result.output
    assert "--batch 512 is" in result.stderr and "training sequence" in result.stderr, result.stderr

