"""End to end: sharded streaming, loading the result, LoRA adapters, base inference, atomicity."""

from __future__ import annotations

import json

import pytest
import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.config import validate_config
from mlxkit.engines.merge.run import run_merge
from test_merge_common import make_base, make_finetune, make_lora, state


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    base = make_base(root / "base", shard="20KB")
    fts = [make_finetune(base, root / f"ft{i}", seed=20 + i, shard="20KB") for i in range(3)]
    return base, fts


def _cfg(models, base=None, **extra):
    return validate_config({"models": [{"model": str(m)} for m in models],
                            "base_model": str(base) if base else None, **extra})


def test_sharded_streaming_output_loads(tmp_path, sharded):
    base, fts = sharded
    assert len(list(base.glob("*.safetensors"))) > 1
    out = tmp_path / "merged"
    result = run_merge(_cfg(fts, base, merge_method="iso-cts", max_shard_size="30KB", out_dtype="bfloat16"), out,
                       device="cpu")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) == result["shards"] > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state(base))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer_config.json").exists() and (out / "mlxkit.json").exists()
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["verb"] == "merge" and manifest["settings"]["merge_method"] == "iso-cts"
    assert all(t.dtype == torch.bfloat16 for t in state(out).values())

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    logits = model(torch.randint(0, 128, (2, 8))).logits
    assert logits.shape == (2, 8, 128) and torch.isfinite(logits).all()

    # the same merge from unsharded copies gives the same tensors
    flat = []
    for i, ft in enumerate([base, *fts]):
        from transformers import LlamaForCausalLM

        dst = tmp_path / f"flat{i}"
        LlamaForCausalLM.from_pretrained(ft).save_pretrained(dst)
        flat.append(dst)
    out2 = tmp_path / "merged-flat"
    run_merge(_cfg(flat[1:], flat[0], merge_method="iso-cts", out_dtype="bfloat16"), out2, device="cpu")
    a, b = state(out), state(out2)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_lora_adapters_and_inferred_base(tmp_path, sharded):
    base, _ = sharded
    expected = [make_lora(tmp_path / f"lora{i}", base, seed=i) for i in range(2)]
    out = tmp_path / "merged"
    result = run_merge(_cfg([tmp_path / "lora0", tmp_path / "lora1"], None, merge_method="task-arithmetic",
                            alpha=0.5), out, device="cpu")
    assert result["base"] == str(base)
    got, b = state(out), state(base)
    for name, w in b.items():
        delta = sum(e.get(name, torch.zeros_like(w)) for e in expected)
        assert torch.allclose(got[name], w + 0.5 * delta, atol=1e-6), name


def test_readme_base_model_inference(tmp_path, sharded):
    base, fts = sharded
    ft = make_finetune(base, tmp_path / "ft", seed=5)
    (ft / "README.md").write_text(f"---\nbase_model:\n  - {base}\nlicense: mit\n---\n# a model\n")
    result = run_merge(_cfg([ft], None, merge_method="iso-c"), tmp_path / "o", device="cpu")
    assert result["base"] == str(base)


def test_missing_base_is_a_clear_error(tmp_path, sharded):
    _, fts = sharded
    with pytest.raises(InputError, match="needs a base model"):
        run_merge(_cfg(fts, None, merge_method="ties"), tmp_path / "o", device="cpu")


def test_vocab_mismatch_names_tensor_and_models(tmp_path, sharded):
    base, fts = sharded
    other = make_base(tmp_path / "bigvocab", vocab_size=136)
    with pytest.raises(InputError, match=r"vocabulary mismatch: 'model.embed_tokens.weight' is 128x32 .* 136x32"):
        run_merge(_cfg([fts[0], other], base, merge_method="iso-c"), tmp_path / "o", device="cpu")
    wide = make_base(tmp_path / "wide", intermediate_size=48)
    with pytest.raises(InputError, match=r"shape mismatch: 'model.layers.0.mlp.gate_proj.weight' is 64x32 .* but 48x32 in .*wide"):
        run_merge(_cfg([fts[0], wide], base, merge_method="iso-c"), tmp_path / "o", device="cpu")


def test_failure_leaves_no_partial_output(tmp_path, sharded, monkeypatch):
    base, fts = sharded
    from mlxkit.engines.merge.methods import iso_c

    calls = {"n": 0}
    original = iso_c.IsoC.merge

    def flaky(self, tensors, job):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return original(self, tensors, job)

    monkeypatch.setattr(iso_c.IsoC, "merge", flaky)
    with pytest.raises(RuntimeError):
        run_merge(_cfg(fts, base, merge_method="iso-c", max_shard_size="10KB"), tmp_path / "o", device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_per_tensor_filters(tmp_path, sharded):
    base, fts = sharded
    models = [{"model": str(fts[0]), "parameters": {"weight": [{"filter": "mlp", "value": 0.0}, {"value": 1.0}]}},
              {"model": str(fts[1])}]
    cfg = validate_config({"models": models, "base_model": str(base), "merge_method": "task-arithmetic"})
    out = tmp_path / "o"
    run_merge(cfg, out, device="cpu")
    got, b, f0, f1 = state(out), state(base), state(fts[0]), state(fts[1])
    mlp, attn = "model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(got[mlp], f1[mlp], atol=1e-6)
    assert torch.allclose(got[attn], f0[attn] + f1[attn] - b[attn], atol=1e-6)


def test_alpha_auto_sweeps_and_reports_curve(tmp_path, sharded):
    from test_merge_common import add_char_tokenizer

    base, fts = sharded
    tokbase = tmp_path / "base"
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(base).save_pretrained(tokbase)
    add_char_tokenizer(tokbase)
    texts = []
    for i, word in enumerate(["the quick brown fox ", "lorem ipsum dolor "]):
        p = tmp_path / f"val{i}.txt"
        p.write_text(word * 60)
        texts.append(str(p))
    cfg = _cfg(fts[:2], tokbase, merge_method="iso-c", alpha="auto", eval_data=texts, alpha_grid=[0.0, 0.5, 1.0],
               eval_tokens=256, eval_seq_len=32)
    result = run_merge(cfg, tmp_path / "auto", device="cpu")
    assert [p["alpha"] for p in result["alpha_curve"]] == [0.0, 0.5, 1.0]
    best = min(result["alpha_curve"], key=lambda p: p["mean_loss"])["alpha"]
    assert result["alpha"] == best
    fixed = run_merge(_cfg(fts[:2], tokbase, merge_method="iso-c", alpha=best), tmp_path / "fixed", device="cpu")
    a, b = state(tmp_path / "auto"), state(tmp_path / "fixed")
    assert fixed["alpha"] == best and all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)
    assert not list((tmp_path / "auto").glob(".alpha-sweep*"))
