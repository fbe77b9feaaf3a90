"""Typed method parameters, per-tensor seeds and the refusal of non-finite merged tensors."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from mlxkit.engines.core.seeds import derive_seed
from mlxkit.engines.errors import InputError, RecipeError
from mlxkit.engines.merge.config import validate_config
from mlxkit.engines.merge.executor import NonFiniteTensorError, all_finite
from mlxkit.engines.merge.methods import registry
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob, tensor_generator
from mlxkit.engines.merge.plan import plan_merge
from mlxkit.engines.merge.run import run_merge
from mlxkit.engines.merge.sources import resolve_input
from test_merge_common import make_base, make_finetune, state


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("params")
    base = make_base(root / "base")
    return base, [make_finetune(base, root / f"ft{i}", seed=40 + i) for i in range(2)]


def _cfg(fts, base, **extra):
    return validate_config({"models": [{"model": str(f)} for f in fts], "base_model": str(base), **extra})


# ---- ParamDef ------------------------------------------------------------------------------------

def test_param_def_types_ranges_and_messages():
    density = ParamDef("density", float, 0.2, "kept fraction", low=0.0, high=1.0)
    assert density.check(0.3) == 0.3 and density.check(1) == 1.0 and density.check("1e-3") == 0.001
    for bad in ("abc", 2, -1, float("nan"), "nan", float("inf"), True, None, [0.5], 10**400):
        with pytest.raises(InputError, match=r"^density must be a number in \[0, 1\] \(got "):
            density.check(bad)
    frac = ParamDef("common_frac", float, 0.8, "", low=0.0, low_open=True, high=1.0)
    assert frac.valid_values() == "a number in (0, 1]"
    with pytest.raises(InputError, match=r"\(0, 1\] \(got 0\)"):
        frac.check(0)
    iters = ParamDef("power_iters", int, 4, "", low=0)
    assert iters.check(3) == 3 and iters.check(3.0) == 3 and iters.check("7") == 7
    for bad in (2.5, -1, "x", False):
        with pytest.raises(InputError, match="power_iters must be an integer >= 0"):
            iters.check(bad)
    flag = ParamDef("exact", bool, False, "")
    assert flag.check(True) is True
    with pytest.raises(InputError, match="exact must be true or false"):
        flag.check(1)
    weight = ParamDef("weight", float, 1.0, "")
    assert weight.check(-2) == -2.0 and weight.valid_values() == "a finite number"


def test_every_method_declares_valid_defaults_once():
    for method in registry.METHODS.values():
        declared = [*method.parameters(), *method.model_parameters()]
        assert len({p.name for p in declared}) == len(declared), method.name
        for pdef in declared:
            assert pdef.type in (bool, int, float) and pdef.help, (method.name, pdef.name)
            if not pdef.required:
                assert pdef.check(pdef.default) == pdef.default, (method.name, pdef.name)


def test_validated_config_holds_typed_values():
    cfg = validate_config({"models": [{"model": "org/a", "parameters": {"density": "0.5",
                                                                      "weight": [{"filter": "mlp", "value": "2"}]}},
                                      {"model": "org/b"}],
                           "base_model": "org/base", "merge_method": "ties", "parameters": {"normalize": False},
                           "alpha": "0.5"})
    assert cfg.alpha == 0.5 and cfg.models[0].parameters["density"] == 0.5
    assert cfg.models[0].parameters["weight"][0].value == 2.0
    again = validate_config(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_duplicate_hub_ids_and_required_parameters(monkeypatch):
    with pytest.raises(RecipeError, match=r"models\.1\.model: 'org/a' is the same model as models\.0"):
        validate_config({"models": [{"model": "org/a"}, {"model": "org/a"}], "base_model": "org/base"})

    class Needy(MergeMethod):
        name = "needy"

        def parameters(self):
            return [ParamDef("k", int, None, "how many", required=True, low=1)]

        def model_parameters(self):
            return [ParamDef("w", float, None, "per-model weight", per_model=True, required=True)]

        def merge(self, tensors, job):
            return tensors[0]

    monkeypatch.setitem(registry.METHODS, "needy", Needy())
    data = {"models": [{"model": "org/a", "parameters": {"w": 1}}, {"model": "org/b"}], "merge_method": "needy"}
    with pytest.raises(RecipeError) as info:
        validate_config(data)
    message = str(info.value)
    assert "parameters.k: method 'needy' needs 'k'" in message and "models.1.parameters.w" in message
    assert "models.0" not in message
    validate_config({**data, "parameters": {"k": 2, "w": 0.5}})  # a global value serves every model


# ---- seeds ---------------------------------------------------------------------------------------

def test_plan_seeds_are_derived_per_tensor_name_not_order(models):
    base, fts = models
    cfg = _cfg(fts, base, merge_method="dare-ties", seed=7)
    forward = plan_merge(cfg, [resolve_input(str(f)) for f in fts], resolve_input(str(base)))
    inputs, reference = [resolve_input(str(f)) for f in fts], resolve_input(str(base))
    index = reference.loader.index
    index.tensors = dict(reversed(list(index.tensors.items())))  # plan the tensors in the opposite order
    backward = plan_merge(cfg, inputs, reference)
    assert [t.name for t in backward.tasks] == [t.name for t in reversed(forward.tasks)]
    seeds = {t.name: t.seed for t in forward.tasks}
    assert seeds == {t.name: t.seed for t in backward.tasks}
    assert all(seed == derive_seed(7, "merge", name) for name, seed in seeds.items())
    assert len(set(seeds.values())) == len(seeds)


def test_tensor_generator_is_per_model_and_reproducible():
    job = TensorJob("w", False, {}, [{}, {}], seed=derive_seed(0, "merge", "w"))
    draws = [torch.rand(8, generator=tensor_generator(job, i, torch.device("cpu"))) for i in (0, 1, 0)]
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


# ---- non-finite results --------------------------------------------------------------------------

def _poison(model, name, value=float("nan")):
    from safetensors.torch import load_file, save_file

    file = model / "model.safetensors"
    tensors = load_file(str(file))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_all_finite():
    assert all_finite(torch.full((1000,), 3e38))  # the float32 sum overflows; the values do not
    assert not all_finite(torch.tensor([1.0, float("nan")])) and not all_finite(torch.tensor([float("-inf")]))
    assert all_finite(torch.arange(5)) and all_finite(torch.zeros(0))


NAME = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("where", ["model", "base"])
def test_non_finite_input_is_refused_and_named(tmp_path, models, where):
    import shutil

    base, fts = models
    copies = [shutil.copytree(p, tmp_path / p.name) for p in (base, *fts)]
    culprit = copies[1] if where == "model" else copies[0]
    _poison(culprit, NAME, float("inf") if where == "base" else float("nan"))
    with pytest.raises(NonFiniteTensorError, match=rf"'{culprit}' has NaN or infinite values in '{NAME}'"):
        run_merge(_cfg(copies[1:], copies[0], merge_method="task-arithmetic"), tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_method_that_produces_nan_is_refused(tmp_path, models, monkeypatch):
    from mlxkit.engines.merge.methods.ties import Ties

    base, fts = models
    monkeypatch.setattr(Ties, "merge", lambda self, tensors, job: tensors[0] * math.nan)
    with pytest.raises(NonFiniteTensorError, match="produced NaN or infinite values from finite inputs"):
        run_merge(_cfg(fts, base, merge_method="ties"), tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_overflow_into_a_narrow_output_dtype_is_refused(tmp_path, models):
    base, _ = models
    loud = [make_finetune(base, tmp_path / f"loud{i}", seed=i, scale=1000.0) for i in range(2)]
    cfg = _cfg(loud, base, merge_method="task-arithmetic", alpha=100, out_dtype="float16")
    with pytest.raises(NonFiniteTensorError, match="overflows to infinity in float16 at alpha 100"):
        run_merge(cfg, tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()
    run_merge(_cfg(loud, base, merge_method="task-arithmetic", alpha=100), tmp_path / "wide", device="cpu")
    assert all(torch.isfinite(t).all() for t in state(tmp_path / "wide").values())


@pytest.mark.parametrize("name", ["iso-cts-example", "ties-example"])
def test_bundled_recipes_validate(name):
    from mlxkit.engines.merge.config import read_recipe

    cfg = validate_config(read_recipe(name), origin=name)  # paths need not exist: validation reads no weights
    assert cfg.models and registry.get(cfg.merge_method)
