"""Helpers for the merge tests: tiny random Llamas and hand-written PEFT adapters (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)


def make_base(path: Path, seed: int = 0, shard: str | None = None, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


def make_finetune(base: Path, path: Path, seed: int, scale: float = 0.05, shard: str | None = None) -> Path:
    """The base plus a random full-rank delta on every tensor."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


def state(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (tests only: fine for tiny models)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def make_lora(path: Path, base: Path, seed: int, r: int = 4, alpha: float = 8.0,
              targets=("q_proj", "v_proj", "down_proj")) -> dict[str, torch.Tensor]:
    """A PEFT-format LoRA adapter dir written by hand; returns the expected delta per weight."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    base_state = state(base)
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, w in base_state.items():
        module = name.removesuffix(".weight")
        if not any(module.endswith(t) for t in targets):
            continue
        out_f, in_f = w.shape
        a = torch.randn(r, in_f, generator=gen) * 0.1
        b = torch.randn(out_f, r, generator=gen) * 0.1
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[name] = (b @ a) * (alpha / r)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
        "base_model_name_or_path": str(base), "fan_in_fan_out": False}))
    return deltas


def add_char_tokenizer(path: Path) -> Path:
    """A 97-token character-level tokenizer (fits the tiny vocab of 128), saved into `path`."""
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): i + 1 for i, c in enumerate(range(32, 127))}, "\n": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=tokenizers.Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return path
