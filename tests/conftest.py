"""Shared fixtures: tiny random Llama checkpoints built on the fly, and an isolated cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import os

REPO = Path(__file__).resolve().parents[1]
# The user's real cache, where `make test`'s setup put the converted default model.
REAL_CACHE = os.environ.get("MLXKIT_CACHE")
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own MLXKIT_CACHE and never reaches a model hub."""
    if not hasattr(_isolated_cache, "root"):
        _isolated_cache.root = tmp_path_factory.mktemp("mlxkit-cache")
    monkeypatch.setenv("MLXKIT_CACHE", str(_isolated_cache.root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_tiny_llama(seed: int = 0, **overrides):
    """A random Llama: hidden 32, 2 layers, 4 query heads, 2 KV heads, vocab 128 (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    with torch.no_grad():  # default init is tiny; widen it so blocks matter and tests can fail
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    return model


def make_char_tokenizer(vocab_size: int = 128):
    """A byte-level BPE tokenizer with no merges: one token per byte (ids 3..), specials 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    # Byte-level BPE shows byte b as a printable stand-in character; keep tab, newline and ASCII text.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    stand_in, shift = {}, 0
    for byte in range(256):
        stand_in[byte] = chr(byte) if byte in printable else chr(256 + shift)
        shift += byte not in printable
    wanted = [9, 10] + list(range(32, 127))
    alphabet = [stand_in[b] for b in wanted][: vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


@pytest.fixture
def real_cache(monkeypatch):
    """Slow tests read the real default model from the user's cache instead of converting it again."""
    if REAL_CACHE is None:
        monkeypatch.delenv("MLXKIT_CACHE", raising=False)
    else:
        monkeypatch.setenv("MLXKIT_CACHE", REAL_CACHE)


@pytest.fixture
def tiny_llama_dir(tmp_path) -> Path:
    """A tiny random Llama saved as an HF directory with a byte-level tokenizer."""
    out = tmp_path / "tiny-llama"
    make_tiny_llama().save_pretrained(out)
    make_char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(_sample_text())
    return path


def _sample_text() -> str:
    """Real prose for tests: the wikitext-2 validation split when present, else generated lines."""
    source = SHARED_DATA / "wikitext2-valid.txt"
    if source.exists():
        return source.read_text(encoding="utf-8")[:20000]
    return "".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(400))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


TINY_PUZZLE_RECIPE = """
name: tiny
search_space: {ffn_fractions: [1.0, 0.5], width_multiple: 8}
data: {seq_len: 32, train_sequences: 8, score_sequences: 2}
bld: {tokens_per_block: 1024, batch_sequences: 4, lr: 1.0e-3}
"""


@pytest.fixture
def tiny_recipe_file(tmp_path) -> Path:
    """A Puzzle recipe sized for the tiny Llama: 4 attention and 4 FFN variants per layer."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_PUZZLE_RECIPE)
    return path
