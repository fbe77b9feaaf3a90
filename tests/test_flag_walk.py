"""Every verb and mode through every flag: no flag is accepted and then dropped without a word.

Two halves. A verb with modes (`ModeOptions`) is walked behaviourally: each mode is run with each
option it does not read, and must refuse it with one error line naming the flag and the mode. Every
verb, with modes or without, is read structurally: each parameter of its command function is used in
the function's body (an unused parameter is a flag the CLI parses and drops).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest
import typer
from typer.testing import CliRunner

from mlxkit.cli.main import app

runner = CliRunner()
# A valid value per option, where any text would fail a check that runs before the mode's (placement, pairs).
VALUES = {"device": "cpu", "dtype": "float32", "save_dtype": "float32", "sharding": "none", "overrides": "a.b=1",
          "gkd_overrides": "a.b=1", "gkd_set": "a.b=1", "params": "a=1", "attacks": "linf", "new_attack": "l2",
          "text_field": "text", "seed": "1", "refine": "1", "grid": "4x4", "leaf": "8", "costs": "profile"}


def _leaf_commands(group, prefix: str = "") -> dict:
    """Every command that runs, by its path under `mlx` ("search", "library build"): a sub-app's commands too."""
    found = {}
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        found.update(_leaf_commands(command, f"{path} ") if hasattr(command, "commands") else {path: command})
    return found


COMMANDS = _leaf_commands(typer.main.get_command(app))


def _command(verb: str):
    return COMMANDS[verb]


def _module_modes(verb: str):
    module = inspect.getmodule(_command(verb).callback)
    return getattr(module, "_MODES", None)


def _mode_args(tmp_path) -> dict[str, dict[str, list[str]]]:
    system = tmp_path / "a.npz"
    system.write_bytes(b"")
    out = str(tmp_path / "out")
    return {
        "distill": {"--bld": ["distill", "--bld", "--out", out], "--gkd": ["distill", "--gkd", "--out", out],
                    "--kd": ["distill", "--kd", "--out", out]},
        "finetune": {"--recipe htuning|lora|full": ["finetune", "--recipe", "lora", "--data", "t.txt", "--out", out],
                     "--recipe crt": ["finetune", "--recipe", "crt", "--data", "d.npz", "--out", out]},
        "search": {"--costs-only": ["search", "--costs-only", "--target", "cpu"],
                   "without --costs-only": ["search", "--target", "cpu", "--out", out]},
        "solve": {"--method auto|ssi": ["solve", str(system), "--method", "ssi"],
                  "--method superlu|pardiso": ["solve", str(system), "--method", "superlu"]},
    }


def _option_args(param) -> list[str]:
    flag = next(o for o in param.opts if o.startswith("--"))
    if getattr(param, "is_flag", False):
        # A --x/--no-x pair: the spelling that differs from the default is the one a user types.
        secondary = getattr(param, "secondary_opts", [])
        return [secondary[0]] if param.default and secondary else [flag]
    if param.name in VALUES:
        return [flag, VALUES[param.name]]
    annotation = param.type_descriptor.annotation
    if annotation in (int, float) or set(typing.get_args(annotation)) & {int, float}:
        return [flag, "1"]
    return [flag, "x"]


def _walk(tmp_path) -> list[tuple]:
    cases = []
    for verb, modes in _mode_args(tmp_path).items():
        options = _module_modes(verb)
        assert options is not None and set(options.modes) == set(modes), (verb, options and set(options.modes))
        for mode, args in modes.items():
            read = options.common | options.modes[mode]
            for param in _command(verb).params:
                if param.param_type_name == "option" and param.name not in read and param.name != "help":
                    cases.append((verb, mode, param, args))
    return cases


def test_every_mode_refuses_every_option_it_does_not_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = _walk(tmp_path)
    assert len(cases) > 40  # the walk reached every verb's modes
    silent = []
    for verb, mode, param, args in cases:
        extra = _option_args(param)
        if extra[0] in args:
            continue  # the mode's own selector (e.g. --method) is read by every mode
        result = runner.invoke(app, [*args, *extra])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        refused = (result.exit_code == 2 and len(errors) == 1 and extra[0] in errors[0]
                   and f"{verb} {mode}" in errors[0])
        if not refused:
            silent.append(f"{verb} {mode} {' '.join(extra)}: exit {result.exit_code}, {errors or result.output[-200:]}")
    assert not silent, "\n".join(silent)


def _unused_parameters(function) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef)
    names = [a.arg for a in definition.args.args + definition.args.kwonlyargs]
    used = {node.id for statement in definition.body for node in ast.walk(statement) if isinstance(node, ast.Name)}
    return [name for name in names if name not in used]


def test_the_walk_reaches_sub_apps():
    assert "library build" in COMMANDS and "library" not in COMMANDS


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_every_flag_of_every_verb_is_read(verb):
    callback = _command(verb).callback
    assert _unused_parameters(callback) == [], f"mlx {verb} parses these and never reads them"
    options = _module_modes(verb)
    if options is not None:
        # Each of the verb's parameters is read by every mode or named by one; a new flag must say which.
        named = options.common.union(*options.modes.values())
        unnamed = {p.name for p in _command(verb).params if p.param_type_name == "option"} - named - {"help"}
        assert unnamed == set(), f"mlx {verb}: no mode says it reads {sorted(unnamed)}"


def test_the_structural_check_sees_an_unused_parameter():
    def command(a: int, b: int, ctx=None) -> None:
        print(a, ctx)

    assert _unused_parameters(command) == ["b"]
