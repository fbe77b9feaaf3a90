"""`library build` with a streamed parent: the same library as with the whole parent in memory, bit for
bit, while at most one decoder layer is ever read in; and an activation cache that resumes per layer."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import make_char_tokenizer, make_tiny_llama, recording_reporter, save_with_tokenizer
from mlxkit.engines.core.progress import Reporter, TaskHandle
from mlxkit.engines.data.sampled import model_fingerprint
from mlxkit.engines.models.decilm.convert import ResidentParent, StreamedParent, from_parent
from mlxkit.engines.models.loading import load_config, load_model
from mlxkit.engines.puzzle.library import activations, build, scoring
from mlxkit.engines.puzzle.library.build import LibraryBuildOptions, run_library_build
from mlxkit.engines.puzzle.recipe import load_recipe
from mlxkit.engines.training.device import Placement


def _options(parent: Path, recipe: Path, out: Path, **extra) -> LibraryBuildOptions:
    extra.setdefault("data", None)
    extra.setdefault("keep_activations", True)  # these tests compare the activation caches
    return LibraryBuildOptions(model=str(parent), out=out, recipe=load_recipe(str(recipe)), device="cpu", **extra)


def _tensors(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: load_file(str(path)) for path in sorted(directory.glob("*.safetensors"))}


def _same_tensors(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(a[f].keys() == b[f].keys() and all(torch.equal(a[f][k], b[f][k])
                                                                           for k in a[f]) for f in a)


def _scores(directory: Path) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def _index_without_timings(root: Path) -> dict:
    index = json.loads((root / "library.json").read_text())
    for layer in index["layers"]:
        for kind in ("attention", "ffn"):
            for entry in layer[kind].values():
                (entry.get("training") or {}).pop("seconds", None)
    return index


class _LayerWatch:
    """Counts the decoder layers a streamed parent holds at once, and the whole-parent loads."""

    def __init__(self, monkeypatch) -> None:
        self.most_held, self.whole_loads = 0, 0
        hold = StreamedParent.hold
        load = build._load_parent

        def watched_hold(parent, index):
            with hold(parent, index) as layer:
                self.most_held = max(self.most_held, len(parent.held()))
                yield layer

        def counted_load(*args, **kwargs):
            self.whole_loads += 1
            return load(*args, **kwargs)

        monkeypatch.setattr(StreamedParent, "hold", contextlib.contextmanager(watched_hold))
        monkeypatch.setattr(build, "_load_parent", counted_load)


@pytest.fixture
def deep_parent(tmp_path) -> Path:
    """The tiny Llama with 4 layers and a tied head (a streamed pass then spans several layers)."""
    return save_with_tokenizer(make_tiny_llama(num_hidden_layers=4, tie_word_embeddings=True), tmp_path / "parent")


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_library_equals_the_resident_one(tied, tmp_path, tiny_recipe_file, text_file, monkeypatch):
    parent = save_with_tokenizer(make_tiny_llama(num_hidden_layers=3, tie_word_embeddings=tied), tmp_path / "p")
    resident = tmp_path / "resident"
    run_library_build(_options(parent, tiny_recipe_file, resident, data=text_file, stream=False))
    # A budget of three variants' held-out states: scoring takes several passes over the tail.
    monkeypatch.setattr(scoring, "STATE_BUDGET_BYTES", 3 * 2 * 32 * 32 * 4)
    watch = _LayerWatch(monkeypatch)
    streamed = tmp_path / "streamed"
    run_library_build(_options(parent, tiny_recipe_file, streamed, data=text_file))
    assert watch.whole_loads == 0 and watch.most_held == 1
    for sub in ("blocks", ".work/activations"):
        assert _same_tensors(_tensors(resident / sub), _tensors(streamed / sub)), sub
    assert _scores(resident / "scores") == _scores(streamed / "scores")  # exact: every float equal
    index = _index_without_timings(streamed)
    assert _index_without_timings(resident)["run_key"]["parent"] == index["run_key"]["parent"]
    assert _index_without_timings(resident) == index


def test_streamed_scoring_reports_progress_inside_a_pass(deep_parent, tiny_recipe_file, text_file, tmp_path):
    """A pass yields its scores only after its last layer, so the scoring task must move before that:
    the task's advances add up to the variants it scores, and most of them come before the first score."""
    events: list[tuple[str, float]] = []

    class Handle(TaskHandle):
        def advance(self, amount: float = 1.0) -> None:
            events.append(("advance", amount))

        def update(self, **fields: object) -> None:
            events.append(("scored", 0.0))

    class ScoringWatch(Reporter):
        @contextlib.contextmanager
        def task(self, description: str, total: int | None = None):
            if description.startswith("scoring"):
                events.append(("total", float(total)))
                yield Handle()
            else:
                yield TaskHandle()

    run_library_build(_options(deep_parent, tiny_recipe_file, tmp_path / "lib", data=text_file), ScoringWatch())
    assert events[0][0] == "total"
    variants = events[0][1]
    advances = [amount for kind, amount in events if kind == "advance"]
    assert variants > 1 and sum(advances) == pytest.approx(variants)
    before_first_score = sum(a for kind, a in events[1:events.index(("scored", 0.0))] if kind == "advance")
    # One pass over 4 layers: every variant's layer steps come before the first head is scored.
    assert before_first_score > 0.5 * variants


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("llama-tied", torch.bfloat16),
                                          ("qwen2", torch.float32)])
def test_streamed_parent_reads_the_converted_parents_tensors(family, dtype, tmp_path):
    if family == "qwen2":  # no o_proj bias in the checkpoint: the converted class holds zeros
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                             max_position_embeddings=128, tie_word_embeddings=True)).eval()
    else:
        model = make_tiny_llama(tie_word_embeddings=family == "llama-tied")
    path = save_with_tokenizer(model, tmp_path / family)
    whole = from_parent(load_model(str(path), dtype=dtype).model)
    streamed = StreamedParent.open(path, load_config(str(path)), dtype=dtype, device="cpu", spec=str(path))
    assert streamed is not None
    expected = whole.state_dict()
    for i in range(2):
        with streamed.hold(i) as layer:
            for name, tensor in layer.state_dict().items():
                assert torch.equal(tensor, expected[f"model.layers.{i}.{name}"]), name
        assert all(p.is_meta for p in streamed.model.model.layers[i].parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(streamed.model.state_dict()[name], expected[name])
    assert torch.equal(streamed.model.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)
    # The run key's fingerprint, read from the files, is the resident parent's.
    whole.config._attn_implementation = streamed.config._attn_implementation
    assert build._parent_fingerprint(streamed) == model_fingerprint(whole)
    assert build._parent_fingerprint(ResidentParent(whole)) == model_fingerprint(whole)


def test_a_killed_cache_recomputes_only_the_unfinished_layers(deep_parent, tiny_recipe_file, text_file, tmp_path,
                                                              monkeypatch):
    reference = tmp_path / "reference"
    run_library_build(_options(deep_parent, tiny_recipe_file, reference, data=text_file, score=False, train=False))

    computed: list[int] = []
    real = activations.layer_states

    def layer_states(layer, *args, **kwargs):
        computed.append(layer.self_attn.layer_idx)
        if kill and layer.self_attn.layer_idx == 2:
            raise KeyboardInterrupt("killed at layer 2")
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(activations, "layer_states", layer_states)
    out = tmp_path / "lib"
    kill = True
    with pytest.raises(KeyboardInterrupt):
        run_library_build(_options(deep_parent, tiny_recipe_file, out, data=text_file, score=False, train=False))
    cache = out / ".work" / "activations"
    assert sorted(p.name for p in cache.glob("*.safetensors")) == ["layer000.safetensors", "layer001.safetensors"]
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.glob("*.safetensors")}

    kill, computed[:] = False, []
    run_library_build(_options(deep_parent, tiny_recipe_file, out, data=text_file, score=False, train=False))
    assert computed == [2, 3]
    assert {name: (cache / name).stat().st_ino for name in stamps} == {n: s[0] for n, s in stamps.items()}
    assert {name: (cache / name).stat().st_mtime_ns for name in stamps} == {n: s[1] for n, s in stamps.items()}
    assert _same_tensors(_tensors(reference / ".work" / "activations"), _tensors(cache))


def test_a_cache_killed_before_its_final_file_resumes_at_the_end(deep_parent, tiny_recipe_file, text_file, tmp_path,
                                                                  monkeypatch):
    reference = tmp_path / "reference"
    run_library_build(_options(deep_parent, tiny_recipe_file, reference, data=text_file, score=False, train=False))
    out = tmp_path / "lib"
    run_library_build(_options(deep_parent, tiny_recipe_file, out, data=text_file, score=False, train=False))
    cache = out / ".work" / "activations"
    (cache / "final.safetensors").unlink()
    monkeypatch.setattr(activations, "layer_states", lambda *a, **k: pytest.fail("a cached layer was recomputed"))
    run_library_build(_options(deep_parent, tiny_recipe_file, out, data=text_file, score=False, train=False))
    assert _same_tensors(_tensors(reference / ".work" / "activations"), _tensors(cache))


def test_sampling_loads_the_whole_parent_once_then_streams(deep_parent, tiny_recipe_file, tmp_path, monkeypatch):
    watch = _LayerWatch(monkeypatch)
    out = tmp_path / "lib"
    run_library_build(_options(deep_parent, tiny_recipe_file, out, score=False, train=False))
    assert watch.whole_loads == 1 and watch.most_held == 1
    # Resumed with its tokens cached: nothing loads the whole parent again.
    (out / ".work" / "activations" / "final.safetensors").unlink()
    run_library_build(_options(deep_parent, tiny_recipe_file, out, score=False, train=False))
    assert watch.whole_loads == 1




def test_a_parent_without_safetensors_is_held_whole(tmp_path):
    path = tmp_path / "pickled"
    model = make_tiny_llama()
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    make_char_tokenizer().save_pretrained(path)
    notices = recording_reporter()
    options = LibraryBuildOptions(model=str(path), out=tmp_path / "lib", recipe=load_recipe("quick"), allow_pickle=True,
                             device="cpu")
    parent, layers, _, _ = build._open_parent(options, Placement.cpu(), notices)
    assert isinstance(layers, ResidentParent) and not any(p.is_meta for p in parent.parameters())
    assert any("holding it whole in memory" in line for line in notices.lines)


def test_a_streamed_parent_with_a_nan_weight_is_refused(tmp_path, tiny_recipe_file, text_file):
    from mlxkit.engines.errors import NonFiniteError

    model = make_tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    path = save_with_tokenizer(model, tmp_path / "nan")
    with pytest.raises(NonFiniteError, match="model.layers.1.mlp.up_proj.weight"):
        run_library_build(_options(path, tiny_recipe_file, tmp_path / "lib", data=text_file))


def _mixed_choices(num_layers: int):
    from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant

    picks = [BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 64)),
             BlockChoice(AttentionVariant("gqa", 2), FFNVariant("linear")),
             BlockChoice(AttentionVariant("no_op"), FFNVariant("mlp", 32)),
             BlockChoice(AttentionVariant("linear"), FFNVariant("no_op"))]
    return [picks[i % len(picks)] for i in range(num_layers)]


@pytest.mark.parametrize("tied,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_write_child_equals_the_assembled_child(tied, dtype, tmp_path, tiny_recipe_file, text_file):
    from transformers import AutoModelForCausalLM

    import mlxkit
    from mlxkit.engines.puzzle.search.assemble import assemble_child, write_child
    from mlxkit.engines.puzzle.library.store import LibraryDir

    mlxkit.register_auto_classes()
    parent_dir = save_with_tokenizer(make_tiny_llama(num_hidden_layers=4, tie_word_embeddings=tied), tmp_path / "p")
    library = LibraryDir(tmp_path / "lib")
    run_library_build(_options(parent_dir, tiny_recipe_file, library.root, data=text_file, score=False, train=False))
    choices = _mixed_choices(4)
    parent = from_parent(load_model(str(parent_dir)).model)
    expected = assemble_child(parent, library, choices, dtype=dtype).state_dict()

    out = write_child(parent_dir, library, choices, tmp_path / "child", dtype=dtype, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    written = {name: t for shard in out.glob("*.safetensors") for name, t in load_file(str(shard)).items()}
    assert ("lm_head.weight" in written) == (not tied)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == dtype
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == dtype and torch.equal(state[name], tensor), name


def test_write_child_refuses_a_missing_block(built_library, tiny_llama_dir, tmp_path):
    from mlxkit.engines.errors import InputError
    from mlxkit.engines.puzzle.search.assemble import write_child
    from mlxkit.engines.puzzle.library.store import LibraryDir

    library = LibraryDir(built_library)
    choices = _mixed_choices(2)
    library.block_file(1, "ffn", "linear").unlink()
    with pytest.raises(InputError, match="no block for layer 1 ffn linear"):
        write_child(tiny_llama_dir, library, choices, tmp_path / "child")
