"""The search space a serving engine and an export format can hold.

A cached library is built and scored only for those variants (`search_variants`), and extended
when a later search needs more; a library's variants are filtered again at solve time, so any
library, `--library` included, serves every engine."""

from __future__ import annotations

from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.profile import HardwareProfile
from mlxkit.engines.models.decilm.blocks import BlockChoice
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.search.options import SearchOptions
from mlxkit.engines.puzzle.search_space import VariantFilter

def serving_engine(options: SearchOptions, profile: HardwareProfile, parent_spec: str | None,
                    reporter: Reporter):
    """The engine the child is searched for: `--engine`, else the one `--export` implies, else the profile's.

    An engine the user named that cannot hold the parent is an error; the profile's default engine
    that cannot hold it gives way to transformers, with a notice that says why.
    """
    from mlxkit.engines.serving.capabilities import (ENGINES, check_engine_format, check_engine_holds_parent,
                                                     engines_for_format, get_engine)

    if options.engine is not None:
        engine, named = get_engine(options.engine), True
        if options.export is not None:
            check_engine_format(engine, options.export)
    else:
        engine, named = get_engine(profile.serving_engine), False
        if options.export is not None and engine.export_format != options.export:
            engine = engines_for_format(options.export)[0]
            reporter.notice(f"--export {options.export}: searching for {engine.title}, which loads it "
                            f"({profile.name}'s usual engine is {profile.serving_engine}; --engine overrides)")
    if parent_spec is None:
        return engine
    config, rope_type = _parent_config_and_rope(parent_spec, reporter)
    try:
        check_engine_holds_parent(engine, config, rope_type)
    except InputError as exc:
        if named:
            raise
        fallback = ENGINES["transformers"]
        reporter.notice(f"{exc}: searching for {fallback.title} instead (pass --engine to choose)")
        return fallback
    return engine


def _parent_config_and_rope(spec: str, reporter: Reporter) -> tuple[Any, str]:
    from mlxkit.engines.export.plan import rope_of
    from mlxkit.engines.models.loading import load_config

    config = load_config(spec, reporter=reporter)
    return config, rope_of(config).rope_type


def search_variants(engine, export: str | None) -> VariantFilter:
    """The variants a search for `engine` (and `--export`'s format, if given) can choose."""
    from mlxkit.engines.export import ffn_expressible

    def ffn(variant, shape) -> bool:
        return engine.holds_ffn(variant, shape.hidden_size) and (
            export is None or ffn_expressible(export, variant, shape.hidden_size))

    why = f"that {engine.title} builds" + (f" and {export} holds" if export is not None else "")
    return VariantFilter(lambda variant, _shape: engine.holds_attention(variant), ffn, why)


def named_engine_variants(name: str, parent_spec: str, reporter: Reporter) -> VariantFilter:
    """`search_variants` of the engine called `name`, refusing a parent that engine cannot hold
    (`mlx library build --engine`: a library built ahead of a search for that engine)."""
    from mlxkit.engines.serving.capabilities import check_engine_holds_parent, get_engine

    engine = get_engine(name)
    config, rope_type = _parent_config_and_rope(parent_spec, reporter)
    check_engine_holds_parent(engine, config, rope_type)
    return search_variants(engine, None)


def engine_library(library: BlockLibrary, engine, reporter: Reporter) -> tuple[BlockLibrary, dict[str, list[str]]]:
    """`library` without the variants `engine` cannot build, and the names of those it dropped, per subblock."""
    hidden = library.parent.shape.hidden_size if library.parent is not None else None
    # Without the parent's shape (an NVlabs demo library) only the kinds can be checked, not the widths.
    keep_ffn = (lambda v: engine.holds_ffn(v, hidden)) if hidden is not None else (lambda v: v.kind in engine.ffn)
    excluded = {
        "attention": sorted({v.name for v in _listed_variants(library, "attention") if not engine.holds_attention(v)}),
        "ffn": sorted({v.name for v in _listed_variants(library, "ffn") if not keep_ffn(v)}),
    }
    if excluded["attention"] or excluded["ffn"]:
        parts = [f"{label} {', '.join(names)}" for label, names in (("attention", excluded["attention"]),
                                                                     ("FFN", excluded["ffn"])) if names]
        keeps = "" if engine.name in ("trtllm", "transformers") else " (--engine trtllm or transformers keeps them)"
        reporter.notice(f"--engine {engine.name}: searching without {' and '.join(parts)}, which {engine.title} "
                        f"cannot build{keeps}")
    why = f"that {engine.title} can build"
    library = library.with_attention_only(engine.holds_attention, why).with_ffn_only(keep_ffn, why)
    return library, excluded


def _listed_variants(library: BlockLibrary, kind: str) -> list[Any]:
    """The variants of `kind` the library's layers list, and those of its recipe's search space, which a
    library built for one engine's search holds only in part."""
    variants = [entry.variant for layer in library.layers for entry in layer.entries(kind).values()]
    if library.parent is not None and library.recipe is not None:
        from mlxkit.engines.puzzle.search_space import build_search_space

        space = build_search_space(library.parent.shape, library.recipe.search_space)
        variants += list(space.attention if kind == "attention" else space.ffn)
    return variants


def exportable_library(library: BlockLibrary, fmt: str, encoding: str, reporter: Reporter) -> BlockLibrary:
    """`library` without the FFN variants that `fmt` cannot hold (attention variants all export)."""
    from mlxkit.engines.export import check_exportable, ffn_expressible

    if library.parent is None:
        raise InputError(f"--export {fmt} needs a library that records its parent's shape (an mlxkit library); "
                         "an NVlabs/puzzle demo library has none")
    check_exportable(library.parent.spec, fmt, encoding, reporter)
    hidden = library.parent.shape.hidden_size
    dropped = sorted({v.name for v in _listed_variants(library, "ffn") if not ffn_expressible(fmt, v, hidden)})
    if dropped:
        reporter.notice(f"--export {fmt}: searching without the FFN variants {', '.join(dropped)}, "
                        f"which {fmt} cannot hold")
    return library.with_ffn_only(lambda variant: ffn_expressible(fmt, variant, hidden), f"that {fmt} can hold")


def check_attention_kept(choices: list[BlockChoice], options: SearchOptions) -> None:
    from mlxkit.engines.errors import InfeasibleError
    from mlxkit.engines.serving.capabilities import get_engine

    engine = get_engine(options.engine or "transformers")
    needs = engine.needs_attention_layer or options.export == "gguf"
    if needs and not any(c.attention.kind == "gqa" for c in choices):
        raise InfeasibleError(f"the solution keeps attention in no layer, and {engine.title} needs at least one: "
                              "loosen the budget, or choose another --engine")
