"""Token shards: the streaming tokeniser gives today's ids, reads back as today's blocks, and survives kills.

The reference everywhere is the in-memory path `tokenize(tokenizer, read_texts(path), max_tokens)`
and `pack`, or, for the split-invariant char tokenizer, the tokenizer run on the whole text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REAL_CACHE, REPO, make_char_tokenizer
from mlxkit.engines.data import token_shards
from mlxkit.engines.data.text import pack, read_texts, tokenize
from mlxkit.engines.data.token_shards import (TokenShards, build_token_shards, repeat_factor, repeat_message,
                                              token_dtype)
from mlxkit.engines.errors import InputError

TESTS = Path(__file__).resolve().parent


def make_bpe_tokenizer(texts: list[str], vocab_size: int = 400):
    """A byte-level BPE trained on `texts`: its ids depend on context, unlike the char tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_word_tokenizer(words: list[str]):
    """Whitespace-split words, one id each (ids follow `words`, after <unk> and </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def _line(i: int) -> str:
    return f"Line {i}: the quick brown fox {'jumps' if i % 3 else 'naps'} over {i * 7 % 13} lazy dogs, café 日本.\n"


@pytest.fixture
def sources(tmp_path) -> dict[str, Path]:
    return write_sources(tmp_path)


def write_sources(tmp_path: Path) -> dict[str, Path]:
    """The same kinds of --data the trainers take, with the awkward cases read_texts handles."""
    txt = tmp_path / "corpus.txt"
    # \r\n and a lone \r are read as \n (universal newlines)
    txt.write_bytes("".join(_line(i) for i in range(300)).replace("\n", "\r\n", 5).replace("dogs", "dogs\r", 1)
                    .encode())
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("".join(_line(i) for i in range(40, 90)))
    (folder / "a.txt").write_text("".join(_line(i) for i in range(0, 40)))
    (folder / "sub" / "c.txt").write_text("".join(_line(i) for i in range(90, 150)))
    for k in range(10):  # enough documents for many batches
        (folder / "sub" / f"d{k}.txt").write_text("".join(_line(i) for i in range(150 + 6 * k, 156 + 6 * k)))
    (folder / "blank.txt").write_text("  \n\t\n")  # whitespace only: skipped, no separator
    (folder / "notes.md").write_text("not read: only .txt files are")
    records = [{"text": "".join(_line(i) for i in range(k, k + 7)), "id": k} for k in range(0, 210, 7)]
    records.insert(3, {"text": "   "})  # whitespace only: skipped
    records.insert(5, {"text": "carriage\r\nreturn kept as written\u2028inside a JSON string"})
    lines = [json.dumps(r) for r in records]
    lines.insert(2, "")  # blank lines are skipped
    # str.splitlines also splits at \x1e and the like: two records on one physical line
    lines[3] = lines[3] + "\x1e" + json.dumps({"text": "".join(_line(i) for i in range(500, 507))})
    lines.insert(9, "   ")
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    return {"txt": txt, "dir": folder, "jsonl": jsonl}


@pytest.fixture
def bpe(sources):
    return make_bpe_tokenizer(read_texts(sources["txt"]))


def _ids(shards: TokenShards) -> torch.Tensor:
    return shards.span(0, len(shards))


class _Counting:
    """Wraps `_encode_batch` to count the characters tokenised, optionally raising at call `fail_at`."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.calls = self.chars = 0
        self.pieces: list[str] = []
        self.fail_at = fail_at
        self._real = token_shards._encode_batch
        monkeypatch.setattr(token_shards, "_encode_batch", self)

    def __call__(self, tokenizer, pieces):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("interrupted between batches")
        self.chars += sum(map(len, pieces))
        self.pieces += pieces
        return self._real(tokenizer, pieces)


# ------------------------------------------------------------------------------- same ids as today
@pytest.mark.parametrize("kind", ["txt", "dir", "jsonl"])
@pytest.mark.parametrize("max_tokens", [None, 1, 4321])
def test_shards_equal_the_in_memory_tokeniser(sources, bpe, tmp_path, kind, max_tokens):
    expected = tokenize(bpe, read_texts(sources[kind]), max_tokens)
    # small shards and batches, so shard ends fall inside pieces, documents and separators
    shards = build_token_shards(sources[kind], bpe, tmp_path / "root", max_tokens=max_tokens, shard_tokens=97,
                                batch_chars=300)
    assert len(shards) == expected.numel()
    assert torch.equal(_ids(shards), expected)
    assert shards.manifest.total_tokens >= len(shards)
    assert len(shards.manifest.shards) == -(-shards.manifest.total_tokens // 97)


def test_char_tokenizer_ids_and_eos_separators(sources, tmp_path):
    tokenizer = make_char_tokenizer()
    shards = build_token_shards(sources["dir"], tokenizer, tmp_path / "root", shard_tokens=1000)
    texts = read_texts(sources["dir"])
    expected = []
    for i, text in enumerate(texts):  # the separator rule, written out: EOS between documents, no BOS
        expected += ([tokenizer.eos_token_id] if i else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
    assert _ids(shards).tolist() == expected
    assert len(texts) == 13 and (_ids(shards) == tokenizer.eos_token_id).sum() == 12


def test_a_document_longer_than_a_piece_is_cut_as_today(tmp_path):
    # Lines of 1,024 characters put every piece end right after a newline, where today's cut keeps
    # all the text, so the two paths must agree token for token across the piece boundary.
    line = ("word " * 205)[:1023] + "\n"
    path = tmp_path / "long.txt"
    with open(path, "w") as handle:
        for i in range(1500):  # 1.5 M characters: two pieces
            handle.write(line if i % 2 else line.replace("word", "wood", 3))
    tokenizer = make_bpe_tokenizer([line, line.replace("word", "wood", 3)], vocab_size=300)
    expected = tokenize(tokenizer, read_texts(path))
    shards = build_token_shards(path, tokenizer, tmp_path / "root")
    assert torch.equal(_ids(shards), expected)


def test_long_documents_keep_every_character(tmp_path):
    # The char tokenizer gives one id per byte wherever the text is cut, so the whole-text ids are the reference.
    text = "".join(_line(i).replace("café 日本", "cafe") * (1 + i % 4) for i in range(200)) + "no newline at the end"
    path = tmp_path / "one.txt"
    path.write_text(text)
    tokenizer = make_char_tokenizer()
    shards = build_token_shards(path, tokenizer, tmp_path / "root", piece_chars=999, batch_chars=2000,
                                shard_tokens=5000)
    assert _ids(shards).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(shards) == len(text.encode())
    assert tokenizer.decode(_ids(shards)) == text


def test_the_in_memory_tokeniser_keeps_every_character_of_a_long_document(tmp_path, monkeypatch):
    from mlxkit.engines.data import text as text_module

    text = "".join(_line(i).replace("café 日本", "cafe") * (1 + i % 4) for i in range(200)) + "no newline at the end"
    path = tmp_path / "one.txt"
    path.write_text(text)
    tokenizer = make_char_tokenizer()
    monkeypatch.setattr(text_module, "PIECE_CHARS", 999)  # many cuts, each at a line end
    assert tokenize(tokenizer, read_texts(path)).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_real_tokenizer_matches_the_in_memory_tokeniser(tmp_path, real_corpus):
    from transformers import AutoTokenizer

    # Only the tokenizer files are read from the user's cache, where `mlx fetch smollm2-135m` put them.
    model = (Path(REAL_CACHE) if REAL_CACHE else Path.home() / ".cache" / "mlxkit") / "models" / "smollm2-135m"
    if not (model / "tokenizer.json").is_file():
        pytest.skip(f"needs the SmolLM2-135M tokenizer in {model} (`mlx fetch smollm2-135m`)")
    tokenizer = AutoTokenizer.from_pretrained(model)
    paragraphs = [p for p in real_corpus.read_text().split("\n \n") if p.strip()][:400]
    txt = tmp_path / "wiki.txt"
    txt.write_text("\n \n".join(paragraphs))  # under one piece
    jsonl = tmp_path / "wiki.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": p}) for p in paragraphs))
    for path in (txt, jsonl):
        expected = tokenize(tokenizer, read_texts(path))
        shards = build_token_shards(path, tokenizer, tmp_path / "root", shard_tokens=10_000, batch_chars=50_000)
        assert torch.equal(_ids(shards), expected), path.name
        assert shards.dtype == np.uint16


@pytest.mark.parametrize("case", ["bad_utf8_txt", "bad_utf8_dir", "bad_utf8_jsonl", "bad_json", "no_field",
                                  "raw_line_separator",
                                  "empty_dir", "blank_txt", "blank_jsonl", "suffix", "missing"])
def test_bad_data_gives_the_same_error_as_today(tmp_path, case):
    path = tmp_path / "data.txt"
    if case == "bad_utf8_txt":
        path.write_bytes(b"fine text\n" * 5000 + b"caf\xe9\n" + b"more\n")
    elif case == "bad_utf8_dir":
        path = tmp_path / "d"
        path.mkdir()
        (path / "a.txt").write_text("good\n")
        (path / "b.txt").write_bytes(b"ok " * 100_000 + b"\xff\xfe tail")
    elif case == "bad_utf8_jsonl":
        path = tmp_path / "data.jsonl"
        path.write_bytes(b'{"text": "a"}\n{"text": "caf\xc3"}\n')
    elif case == "bad_json":
        path = tmp_path / "data.jsonl"
        path.write_text('{"text": "a"}\n\n{"text": oops}\n')
    elif case == "raw_line_separator":  # str.splitlines splits a JSON string at a raw U+2028
        path = tmp_path / "data.jsonl"
        path.write_text(json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n")
    elif case == "no_field":
        path = tmp_path / "data.jsonl"
        path.write_text('{"text": "a"}\n{"body": "b"}\n')
    elif case == "empty_dir":
        path = tmp_path / "d"
        path.mkdir()
        (path / "x.md").write_text("no txt here")
    elif case == "blank_txt":
        path.write_text(" \n\n\t")
    elif case == "blank_jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text('{"text": "  "}\n\n')
    elif case == "suffix":
        path = tmp_path / "data.csv"
        path.write_text("a,b\n")
    else:
        path = tmp_path / "nowhere.txt"
    with pytest.raises(InputError) as old:
        tokenize(make_char_tokenizer(), read_texts(path))
    with pytest.raises(InputError) as new:
        build_token_shards(path, make_char_tokenizer(), tmp_path / "root")
    assert str(new.value) == str(old.value)
    assert not list(tmp_path.rglob("*.bin"))


# ------------------------------------------------------------------------------------------ blocks
def test_blocks_equal_pack_including_blocks_across_shards(sources, bpe, tmp_path):
    expected = pack(tokenize(bpe, read_texts(sources["txt"])), 64)
    shards = build_token_shards(sources["txt"], bpe, tmp_path / "root", shard_tokens=100)
    assert shards.num_blocks(64) == expected.shape[0]
    for i in range(expected.shape[0]):  # most blocks straddle a shard end (64 does not divide 100)
        block = shards.block(i, 64)
        assert block.dtype == torch.long and torch.equal(block, expected[i])
    order = [5, 0, 5, expected.shape[0] - 1]
    assert torch.equal(shards.blocks(order, 64), expected[order])
    assert torch.equal(shards.blocks(torch.tensor(order), 64), expected[order])
    with pytest.raises(IndexError):
        shards.block(expected.shape[0], 64)
    with pytest.raises(InputError):
        shards.num_blocks(1)


def test_a_limit_cuts_the_blocks_like_max_tokens(sources, bpe, tmp_path):
    shards = build_token_shards(sources["txt"], bpe, tmp_path / "root", shard_tokens=100)
    cut = TokenShards(shards.path, limit=1000)
    expected = pack(tokenize(bpe, read_texts(sources["txt"]), 1000), 64)
    assert len(cut) == 1000 and cut.num_blocks(64) == expected.shape[0] == 15
    assert torch.equal(cut.blocks(range(15), 64), expected)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_views_partition_the_blocks(sources, bpe, tmp_path, world):
    expected = pack(tokenize(bpe, read_texts(sources["jsonl"])), 32)
    shards = build_token_shards(sources["jsonl"], bpe, tmp_path / "root", shard_tokens=250)
    views = [shards.for_rank(rank, world) for rank in range(world)]
    per_rank = expected.shape[0] // world
    assert [v.num_blocks(32) for v in views] == [per_rank] * world
    seen = {}
    for rank, view in enumerate(views):
        rows = view.blocks(range(per_rank), 32)
        for j in range(per_rank):
            row = tuple(rows[j].tolist())
            global_index = j * world + rank
            assert torch.equal(rows[j], expected[global_index])
            assert global_index not in seen
            seen[global_index] = row
    assert sorted(seen) == list(range(per_rank * world))  # every block up to the ragged tail, once
    assert expected.shape[0] - per_rank * world < world
    with pytest.raises(InputError):
        views[0].for_rank(0, 2)
    with pytest.raises(InputError):
        shards.for_rank(world, world)


def test_a_rank_maps_only_the_shards_it_reads(sources, bpe, tmp_path):
    shards = build_token_shards(sources["txt"], bpe, tmp_path / "root", shard_tokens=64)
    assert len(shards.manifest.shards) > 2 * token_shards._MAPPED_SHARDS
    view = shards.for_rank(1, 2)
    for j in range(view.num_blocks(64)):
        view.block(j, 64)
        assert len(view._mapped) <= token_shards._MAPPED_SHARDS
    odd = {s for s in range(len(shards.manifest.shards)) if s % 2}
    assert set(view._mapped) <= odd  # with 64-token blocks in 64-token shards rank 1 reads odd shards only


# ------------------------------------------------------------------------------------ cache rules
def test_same_source_and_tokenizer_reuse_the_shards(sources, bpe, tmp_path, monkeypatch):
    first = build_token_shards(sources["txt"], bpe, tmp_path / "root", shard_tokens=500)
    manifest = json.loads((first.path / "manifest.json").read_text())
    assert manifest["source"]["hash"].startswith("sha256:") and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == len(bpe)
    assert manifest["total_tokens"] == sum(s["tokens"] for s in manifest["shards"]) == len(first)
    counter = _Counting(monkeypatch)
    moved = tmp_path / "moved.txt"  # the key is the content, not the path
    moved.write_bytes(sources["txt"].read_bytes())
    again = build_token_shards(moved, bpe, tmp_path / "root", shard_tokens=500)
    again_cut = build_token_shards(sources["txt"], bpe, tmp_path / "root", max_tokens=10)
    assert counter.calls == 0
    assert again.path == first.path == again_cut.path and len(again_cut) == 10
    assert torch.equal(_ids(again), _ids(first))


def test_a_changed_source_or_tokenizer_rebuilds(sources, bpe, tmp_path):
    root = tmp_path / "root"
    before = build_token_shards(sources["txt"], bpe, root)
    with open(sources["txt"], "a") as handle:
        handle.write("one more line\n")
    after = build_token_shards(sources["txt"], bpe, root)
    assert after.path != before.path
    assert torch.equal(_ids(after), tokenize(bpe, read_texts(sources["txt"])))
    other = make_bpe_tokenizer(read_texts(sources["txt"]), vocab_size=350)
    retokenised = build_token_shards(sources["txt"], other, root)
    assert retokenised.path not in (before.path, after.path)
    assert torch.equal(_ids(retokenised), tokenize(other, read_texts(sources["txt"])))
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"text": _line(i), "body": _line(i + 500)}) + "\n" for i in range(50)))
    by_text = build_token_shards(two, bpe, root, text_field="text")
    by_body = build_token_shards(two, bpe, root, text_field="body")
    assert by_body.path != by_text.path
    assert torch.equal(_ids(by_body), tokenize(bpe, read_texts(two, "body")))
    assert torch.equal(_ids(by_text), tokenize(bpe, read_texts(two, "text")))


def test_asking_for_more_tokens_extends_a_cut_build(sources, bpe, tmp_path, monkeypatch):
    root = tmp_path / "root"
    records = read_texts(sources["jsonl"])
    full = tokenize(bpe, records)
    cut = build_token_shards(sources["jsonl"], bpe, root, max_tokens=1500, shard_tokens=300, batch_chars=200)
    assert len(cut) == 1500 and not cut.manifest.complete
    counter = _Counting(monkeypatch)
    more = build_token_shards(sources["jsonl"], bpe, root, max_tokens=2500, shard_tokens=300, batch_chars=200)
    assert torch.equal(_ids(more), full[:2500])
    everything = build_token_shards(sources["jsonl"], bpe, root, shard_tokens=300, batch_chars=200)
    assert torch.equal(_ids(everything), full) and everything.manifest.complete
    # each extension restarts at the record where the last build stopped, not at the first one
    assert records[0] not in counter.pieces and records[1] not in counter.pieces
    assert counter.chars < sum(map(len, records))
    assert torch.equal(_ids(cut), full[:1500])  # a reader opened before the extension still reads its files


# --------------------------------------------------------------------------------- kills and tears
@pytest.mark.parametrize("kind", ["txt", "dir", "jsonl"])
@pytest.mark.parametrize("fail_at", [2, 4, 5, 7])
def test_an_interrupted_build_leaves_no_shards_and_resumes(sources, bpe, tmp_path, monkeypatch, kind, fail_at):
    # The one .txt document is a single piece at the default size; small pieces give it many batches,
    # and the char tokenizer gives the same ids however the text is cut.
    tokenizer, options = (make_char_tokenizer(), {"piece_chars": 300}) if kind == "txt" else (bpe, {})
    options.update(shard_tokens=61, batch_chars=400)
    root = tmp_path / "root"
    expected = tokenize(tokenizer, read_texts(sources[kind]))
    _Counting(monkeypatch, fail_at=fail_at)
    with pytest.raises(KeyboardInterrupt):
        build_token_shards(sources[kind], tokenizer, root, **options)
    assert not any((p / "manifest.json").exists() for p in root.iterdir())
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]  # the shard being written was removed
    counter = _Counting(monkeypatch)
    shards = build_token_shards(sources[kind], tokenizer, root, **options)
    assert torch.equal(_ids(shards), expected)
    assert [p.name for p in root.iterdir() if p.is_dir()] == [shards.path.name]  # no .partial left
    if fail_at > 2:
        assert counter.chars < sum(map(len, read_texts(sources[kind])))  # it resumed, it did not start over


_KILLED_BUILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_data_token_shards import make_bpe_tokenizer
from mlxkit.engines.data import token_shards
from mlxkit.engines.data.text import read_texts
tokenizer = make_bpe_tokenizer(read_texts({txt!r}))  # the fixture's tokenizer: trained the same way
real, calls = token_shards._encode_batch, [0]
def dying(tok, pieces):
    calls[0] += 1
    if calls[0] == {kill_at}:  # SIGKILL: no handler, finally or atexit runs
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tok, pieces)
token_shards._encode_batch = dying
token_shards.build_token_shards({source!r}, tokenizer, {root!r}, shard_tokens=400, batch_chars=400)
"""


def test_a_killed_build_is_never_torn_and_the_rerun_finishes(sources, bpe, tmp_path, monkeypatch):
    root = tmp_path / "root"
    script = _KILLED_BUILD.format(tests=str(TESTS), txt=str(sources["txt"]), source=str(sources["jsonl"]),
                                  root=str(root), kill_at=15)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    [partial] = [p for p in root.iterdir() if p.is_dir()]
    assert partial.name.endswith(".partial")  # nothing under the final name
    progress = json.loads((partial / "progress.json").read_text())
    assert len(progress["shards"]) >= 2
    assert [p for p in partial.iterdir() if ".tmp-" in p.name]  # the kill left the shard it was writing
    # a finished shard torn afterwards (disk trouble) is dropped and rewritten, not trusted
    last = partial / progress["shards"][-1]["file"]
    last.write_bytes(last.read_bytes()[:100])
    counter = _Counting(monkeypatch)
    shards = build_token_shards(sources["jsonl"], bpe, root, shard_tokens=400, batch_chars=400)
    assert torch.equal(_ids(shards), tokenize(bpe, read_texts(sources["jsonl"])))
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".partial")]
    assert 0 < counter.chars < sum(map(len, read_texts(sources["jsonl"])))
    shards.verify()


def test_a_damaged_published_shard_is_refused(sources, bpe, tmp_path):
    shards = build_token_shards(sources["txt"], bpe, tmp_path / "root", shard_tokens=1000)
    first = shards.path / shards.manifest.shards[0].file
    data = bytearray(first.read_bytes())
    data[10] ^= 1
    first.write_bytes(bytes(data))
    with pytest.raises(InputError, match="hash"):
        TokenShards(shards.path).verify()
    first.write_bytes(bytes(data[:-2]))
    with pytest.raises(InputError, match="bytes"):
        TokenShards(shards.path)


# ------------------------------------------------------------------------------------------ dtypes
def test_dtype_is_uint16_up_to_65536_ids():
    assert token_dtype(128) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65537) == np.uint32
    assert token_dtype(152_064) == np.uint32
    with pytest.raises(InputError):
        token_dtype(0)


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tokenizer = make_word_tokenizer(words)
    path = tmp_path / "words.txt"
    path.write_text(" ".join(words[i * 7919 % 70_000] for i in range(5000)) + "\n" + "w69999 w0 w65535 w65536\n")
    shards = build_token_shards(path, tokenizer, tmp_path / "root", shard_tokens=999)
    expected = tokenize(tokenizer, read_texts(path))
    assert shards.dtype == np.uint32 and int(expected.max()) == 70_001
    assert torch.equal(_ids(shards), expected)
    assert (shards.path / shards.manifest.shards[0].file).stat().st_size == 999 * 4
    small = build_token_shards(path, make_word_tokenizer(words[:60_000]), tmp_path / "root")
    assert small.dtype == np.uint16


# -------------------------------------------------------------------------------------- repeats
def test_repeat_factor_and_message():
    assert repeat_factor(12_288, 65_536) == pytest.approx(65_536 / 12_288)
    assert repeat_message(12_288, 65_536) == "the 12,288 training tokens repeat 5.3 times over the 65,536-token budget"
    assert repeat_message(100_000, 25_000) == ("the 25,000-token budget reads 25% of the 100,000 training tokens "
                                               "once (none repeats)")
    with pytest.raises(InputError):
        repeat_factor(0, 10)


# -------------------------------------------------------------------------------------- memory
_MEASURE = """
import json, sys, time, tracemalloc
sys.path.insert(0, {tests!r})
from test_data_token_shards import make_word_tokenizer
from mlxkit.engines.data.text import read_texts, tokenize
from mlxkit.engines.data.token_shards import build_token_shards
tokenizer = make_word_tokenizer([f"w{{i}}" for i in range(5000)])
def status_mb(field):  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent (pytest)
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith(field + ":"))
run = {run!r}
if run["trace"]:
    tracemalloc.start()
before, started = status_mb("VmRSS"), time.time()
if run["path"] == "old":
    tokens = tokenize(tokenizer, read_texts({source!r}), run["max_tokens"]).numel()
else:
    options = {{"piece_chars": run["piece_chars"], "batch_chars": run["piece_chars"]}} if run["piece_chars"] else {{}}
    tokens = len(build_token_shards({source!r}, tokenizer, {root!r}, max_tokens=run["max_tokens"], **options))
traced = tracemalloc.get_traced_memory()[1] / 2**20 if run["trace"] else None
print(json.dumps({{"rss_growth_mb": status_mb("VmHWM") - before, "traced_peak_mb": traced, "tokens": tokens,
                  "seconds": time.time() - started}}))
"""


def test_building_keeps_memory_bounded_by_a_piece_not_the_corpus(tmp_path):
    # ~24 MB of text in 8-word lines over a 5,000-word vocabulary, written a line batch at a time.
    path = tmp_path / "big.txt"
    rng = np.random.default_rng(0)
    n_words = 0
    with open(path, "w") as handle:
        while handle.tell() < 24 * 2**20:
            ids = rng.integers(0, 5000, size=(4096, 8))
            handle.write("".join(" ".join(f"w{i}" for i in row) + "\n" for row in ids))
            n_words += ids.size
    size_mb = path.stat().st_size / 2**20

    def measure(name: str, **run) -> dict:
        run = {"path": "stream", "trace": False, "piece_chars": None, "max_tokens": None, **run}
        script = _MEASURE.format(tests=str(TESTS), source=str(path), root=str(tmp_path / name), run=run)
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    old = measure("old", path="old")
    small_pieces = measure("small", piece_chars=1 << 14)
    traced_all = measure("all", trace=True)
    traced_quarter = measure("quarter", trace=True, max_tokens=n_words // 4)
    assert small_pieces["tokens"] == traced_all["tokens"] == n_words
    assert old["tokens"] == n_words
    results = {"old": old, "small pieces": small_pieces, "traced": traced_all, "traced, a quarter": traced_quarter}
    # The in-memory path holds the text and a list of Python ints (36 bytes a token) at once.
    assert old["rss_growth_mb"] > size_mb * 3, results
    # With small pieces the tokenizer's own working memory is small too, and all of it is far below the text.
    assert small_pieces["rss_growth_mb"] < size_mb / 4, results
    assert small_pieces["rss_growth_mb"] < old["rss_growth_mb"] / 10, results
    # At the default piece size the Python heap's peak is one piece's worth: the same for a quarter of the corpus.
    assert traced_all["traced_peak_mb"] < traced_quarter["traced_peak_mb"] + 1, results
    assert traced_all["traced_peak_mb"] < size_mb * 0.75, results


def test_the_benchmark_generator_is_bounded_and_deterministic(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_tokenize
    finally:
        sys.path.remove(str(REPO / "bench"))
    one = bench_tokenize.write_corpus(tmp_path / "a.txt", 200_000, seed=1, lines=["alpha beta\n", "gamma\n"])
    two = bench_tokenize.write_corpus(tmp_path / "b.txt", 200_000, seed=1, lines=["alpha beta\n", "gamma\n"])
    assert one == two >= 200_000
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
