"""Shared option types and output helpers for every verb.

Every verb ends the same way: `Output(json_out, quiet, verbose)` gives the progress reporter and
then either prints the one `--json` object or hands the result to the verb's renderer. Verbs that
compute take `DeviceOpt` and `DtypeOpt` (and `SaveDtypeOpt` when they write model weights), and
check them with `check_placement` before any model loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Optional, TypeVar

import typer
from rich.console import Console

from mlxkit.cli._errors import fail, stderr_console
from mlxkit.engines.core.progress import Reporter, RichReporter
from mlxkit.engines.training.device import DEVICE_HELP, DTYPE_HELP, SAVE_DTYPE_HELP

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model: HF directory, .gguf file, hub id, or 'smollm2-135m'.")]
DataOpt = Annotated[Optional[Path], typer.Option("--data", help="Text: .txt, .jsonl (with --text-field) or a directory of .txt files. Default: text sampled from the model.")]
TextFieldOpt = Annotated[str, typer.Option("--text-field", help="Field holding the text in a .jsonl file.")]
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="Recipe name (see `mlx recipes`) or path to a YAML file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object with the result on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or notices.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="More detail on stderr.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
AllowPickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickle (.bin) weights. Only for checkpoints you trust.")]

DeviceOpt = Annotated[str, typer.Option("--device", help=DEVICE_HELP, metavar="auto|cpu|cuda|cuda:N")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help=DTYPE_HELP, metavar="auto|float32|bfloat16|float16")]
SaveDtypeOpt = Annotated[Optional[str], typer.Option("--save-dtype", help=SAVE_DTYPE_HELP,
                                                     metavar="float32|bfloat16|float16")]

ShardingOpt = Annotated[str, typer.Option("--sharding", help="How several processes hold the models: auto (FSDP "
                                          "sharding whenever more than one process runs), fsdp, or none (a full "
                                          "replica in every process).", metavar="auto|fsdp|none")]

SET_HELP = "Override a recipe field, key=value (repeatable), e.g. --set optim.lr=3e-4."


def set_option(*aliases: str, help: str = SET_HELP) -> Any:
    """The repeatable `--set key=value` option, with older spellings kept as `aliases`."""
    return Annotated[list[str], typer.Option("--set", *aliases, help=help, metavar="KEY=VALUE")]


SetOpt = set_option()

console = Console()


def launch_rank() -> int:
    """This process's rank under torchrun or accelerate (0 without a launcher)."""
    raw = os.environ.get("RANK", "0").strip()
    return int(raw) if raw.isdigit() else 0


def print_notice(message: str) -> None:
    """One `note:` line on stderr (rank 0 only) about how the command was spelled.

    Not silenced by --quiet: a script that passes --quiet is the one that most needs to hear
    that a spelling it uses has changed.
    """
    if launch_rank() == 0:
        stderr_console.print(f"[yellow]note:[/yellow] {message}", highlight=False, soft_wrap=True)


def renamed_option(old_flag: str) -> Any:
    """A hidden option for the old spelling of a renamed flag; read it with `new_or_old`.

    Kept so scripts written against the old name go on working; `--help` shows only the new name.
    """
    return typer.Option(old_flag, hidden=True)


T = TypeVar("T")


def new_or_old(new_flag: str, new: Optional[T], old_flag: str, old: Optional[T]) -> Optional[T]:
    """The value of a renamed option: `new`, or the old spelling's value with a notice; both is an error."""
    if old is None:
        return new
    if new is not None:
        raise fail(f"{old_flag} is the old spelling of {new_flag}; give only {new_flag}")
    print_notice(f"{old_flag} is now {new_flag}; the old spelling still works")
    return old


def make_reporter(json_out: bool, quiet: bool, verbose: bool) -> Reporter:
    """Progress goes to stderr, as plain timestamped lines with --json (a CI job parses stdout and
    reads the log); --quiet alone silences it.

    Under a launcher only rank 0 reports: the other ranks do the same work on their share, and
    their progress and notices would only repeat rank 0's.
    """
    if quiet or launch_rank() != 0:
        return Reporter()
    return RichReporter(verbose=verbose, plain=json_out)


def emit_json(payload: Any) -> None:
    """The one machine-readable object a verb prints with --json."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


@dataclass
class Output:
    """How a verb reports: progress on stderr, then one JSON object or its own rendering on stdout."""

    json: bool = False
    quiet: bool = False
    verbose: bool = False
    reporter: Reporter = field(init=False)

    def __post_init__(self) -> None:
        self.reporter = make_reporter(self.json, self.quiet, self.verbose)

    def emit(self, result: Any, render: Optional[Callable[[Any], None]] = None) -> None:
        """`--json`: print `result` as the one JSON object; otherwise `render(result)` when given.

        Ranks other than 0 of a launch print nothing: rank 0 reports the run.
        """
        if launch_rank() != 0:
            return
        if self.json:
            emit_json(result)
        elif render is not None:
            render(result)


def check_placement(device: str, dtype: Optional[str] = "auto", save_dtype: Optional[str] = None) -> None:
    """Refuse an unknown or unavailable `--device`/`--dtype`/`--save-dtype` before any work starts.

    The engines resolve the same strings again in each process (under torchrun each rank has its
    own GPU); this call only makes a bad value fail at once, with one line and its exit code.
    """
    from mlxkit.engines.training.device import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    if dtype is not None:
        resolve_dtype(dtype, resolved)
    if save_dtype is not None and save_dtype.strip().lower() not in ("", "auto"):
        resolve_dtype(save_dtype, resolved)


@contextlib.contextmanager
def claimed_output(out: Optional[Path], *, kind: Literal["dir", "file"], inputs: Iterable[Any] = (),
                   lock: bool = True) -> Iterator[Optional[Path]]:
    """Check `--out` before any work (`engines/core/outputs.py`) and hold it for the whole run.

    Under a launcher only rank 0 takes the lock: the other ranks are the same run. `out=None` (a dry
    run, a verb whose output is optional) checks nothing; `lock=False` checks without holding.
    """
    if out is None:
        yield None
        return
    from mlxkit.engines.core.outputs import claim_output

    specs = [str(i) if isinstance(i, Path) else i for i in inputs if isinstance(i, (str, Path))]
    with claim_output(out, kind=kind, inputs=specs, lock=lock and launch_rank() == 0) as resolved:
        yield resolved


def canonical_dtype(spec: Optional[str]) -> Optional[str]:
    """A dtype flag's full torch name (`bf16` → `bfloat16`); None for no value or `auto`."""
    if spec is None or spec.strip().lower() in ("", "auto"):
        return None
    import torch

    from mlxkit.engines.training.device import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(spec, torch.device("cpu")))


def check_pairs(pairs: list[str], flag: str = "--set") -> list[tuple[str, str]]:
    """`key=value` strings split into (key, raw value); the grammar is `engines.core.yaml_config.split_pairs`."""
    from mlxkit.engines.core.yaml_config import split_pairs

    return split_pairs(pairs, flag)


def flags_and_overrides(flags: dict[str, tuple[str, Any]], pairs: list[str], set_flag: str = "--set") -> dict[str, object]:
    """Recipe overrides from a verb's own flags (`{field: (flag, value or None)}`) and `--set` pairs.

    A field given by both is a usage error, whichever value would have won: neither is dropped silently.
    """
    from mlxkit.engines.core.yaml_config import parse_overrides

    overrides = parse_overrides(pairs, set_flag)
    settings: dict[str, object] = {}
    for key, (flag, value) in flags.items():
        if value is None:
            continue
        if key in overrides:
            raise fail(f"{flag} and {set_flag} {key}= both set {key}; give one of them")
        settings[key] = value
    return {**settings, **overrides}


@dataclass(frozen=True)
class ModeOptions:
    """Which of a verb's options each of its modes reads, so an option a mode would drop is refused.

    `common` are the parameters (Python names) every mode reads; `modes` maps a mode's label (as the
    user selects it: `--bld`, `--recipe crt`) to the parameters it reads beyond those. Only options
    the user set (on the command line or through an environment variable) are refused: a default
    means "not given", which `ctx.get_parameter_source` tells apart from a typed value equal to it.
    """

    verb: str
    common: frozenset[str]
    modes: dict[str, frozenset[str]]

    def check(self, ctx: typer.Context, mode: str, also: Iterable[str] = ()) -> None:
        """Refuse (exit 2, one line naming the flag and the mode) every set option `mode` does not read.

        `ctx` is the command's context (a `typer.Context` parameter of the command); `also` adds
        parameters this run reads on top of the mode's (a choice made by another flag).
        """
        read = self.common | self.modes[mode] | frozenset(also)
        unread = [p.name for p in ctx.command.params if p.name not in read]
        for name, flag in given_options(ctx, unread):
            users = [other for other, names in self.modes.items() if other != mode and name in names]
            where = f"; it is for {' and '.join(f'{self.verb} {u}' for u in users)}" if users else ""
            raise fail(f"{flag} means nothing for {self.verb} {mode}, which would ignore it{where}")


def given_options(ctx: typer.Context, names: Iterable[str]) -> list[tuple[str, str]]:
    """(parameter name, flag) of each option among `names` that the user set, in the command's order.

    Set means typed on the command line or given through an environment variable; an option left
    at its default is not set, even when a typed value would equal the default.
    """
    wanted = set(names)
    given = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name not in wanted:
            continue
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given.append((param.name, next((o for o in param.opts if o.startswith("--")), param.opts[0])))
    return given
