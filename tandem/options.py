"""Engine options on the command line, derived once from the configuration.

Every user knob of `EngineConfig` (a field made with `knob()`, which carries its help) becomes
one flag of `tandem serve`, `tandem generate` and `tandem chat`, with the instance default, a
`--x / --no-x` pair for booleans and `choices` for `Literal` fields; `LLM(**options)` takes
the same names. Fields without help (`launch`, `experiments`) are no engine flags; the launch
fields are flags of `tandem serve` only (`add_engine_options(..., launch=True)`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from tandem.config import EngineConfig
from tandem.distributed.launch import Launch

_LAUNCH = "launch."  # the dest prefix of the launch flags


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options: those with a help text."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def engine_dests() -> frozenset[str]:
    """The argparse dests `add_engine_options` may add (the rest of a Namespace is the command's own)."""
    return frozenset([f.name for f in options(EngineConfig)] + [_LAUNCH + f.name for f in options(Launch)])


def add_engine_options(parser: argparse.ArgumentParser, *, launch: bool = False) -> None:
    _add_fields(parser.add_argument_group(
        "engine options", "the fields of tandem.config.EngineConfig (LLM() takes the same keywords)"),
        EngineConfig, "")
    if launch:
        _add_fields(parser.add_argument_group(
            "tensor-parallel launch", "where a group's ranks run when it spans nodes "
                                      "(tandem.distributed.launch)"),
            Launch, _LAUNCH)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The configuration the parsed flags say; with no flags given, exactly `EngineConfig()`."""
    cfg = EngineConfig(**{f.name: getattr(args, f.name) for f in options(EngineConfig)})
    if hasattr(args, _LAUNCH + "nnodes"):
        cfg.launch = Launch(**{f.name: getattr(args, _LAUNCH + f.name) for f in options(Launch)})
    return cfg


def _add_fields(group, cls: type, prefix: str) -> None:
    defaults, hints = cls(), get_type_hints(cls)
    for f in options(cls):
        _add_option(group, f, hints[f.name], getattr(defaults, f.name), prefix + f.name)


def _add_option(group, f: dataclasses.Field, hint: Any, default: Any, dest: str) -> None:
    flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
    help, metavar = f.metadata["help"], f.metadata.get("metavar")
    if hint is bool:
        action = group.add_argument(*flags, dest=dest, default=default, help=help,
                                    action=argparse.BooleanOptionalAction)
    else:
        members = _union(hint)
        optional = type(None) in members
        # The one non-bool type is what a flag takes: `bool | str` (timeline) takes a str.
        (kind,) = [t for t in members if t not in (bool, type(None))]
        choices = list(get_args(kind)) if get_origin(kind) is Literal else None
        parse = _parser(str if choices else kind, optional)
        action = group.add_argument(*flags, dest=dest, default=default, type=parse, help=help,
                                    choices=choices + [None] * optional if choices else None,
                                    metavar=metavar or (None if choices else kind.__name__.upper()))
        if optional and default is not None:
            action.help += "; 'none' unsets it"
    # BooleanOptionalAction adds the default itself on some Pythons; a help may say it in words.
    if "%(default)" not in action.help and "default" not in help:
        action.help += " (default: %(default)s)"


def _union(hint: Any) -> tuple:
    return get_args(hint) if isinstance(hint, types.UnionType) or get_origin(hint) is Union else (hint,)


def _parser(kind: type, optional: bool) -> Callable[[str], Any]:
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        if kind is dict:  # a JSON object (speculative_config)
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
        return kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse
