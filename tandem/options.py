"""Engine options on the command line, derived once from the configuration.

Every user knob of `EngineConfig` (a field made with `knob()`, which carries its help) becomes
one flag of `tandem serve`, `tandem generate` and `tandem chat`, with the instance default, a
`--x / --no-x` pair for booleans and `choices` for `Literal` fields; `LLM(**options)` takes
the same names (`llm_config`), and vLLM's names for them (`VLLM_NAMES`). Fields without help
(`launch`, `experiments`) are no engine flags; the launch fields are flags of `tandem serve`
only (`add_engine_options(..., launch=True)`)."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from tandem.config import EngineConfig, resolve_device
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


def add_engine_fields(parser: argparse.ArgumentParser, *names: str) -> None:
    """Some of `add_engine_options`' flags, for a command that builds its own configuration
    (`tandem bench latency`): the same flag, choices, default and help as everywhere else."""
    unknown = set(names) - {f.name for f in options(EngineConfig)}
    if unknown:
        raise KeyError(f"not engine options: {sorted(unknown)}")
    _add_fields(parser, EngineConfig, "", names)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The configuration the parsed flags say; with no flags given, exactly `EngineConfig()`."""
    cfg = EngineConfig(**{f.name: getattr(args, f.name) for f in options(EngineConfig)})
    if hasattr(args, _LAUNCH + "nnodes"):
        cfg.launch = Launch(**{f.name: getattr(args, _LAUNCH + f.name) for f in options(Launch)})
    return cfg


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """`engine_config`, checked before anything heavy loads: a bad flag, a model path that is
    not there or `--device cuda` without a GPU fails in milliseconds, not after a model load."""
    for name in ("max_total_tokens", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.model is not None and not Path(args.model).expanduser().exists():
        raise FileNotFoundError(f"--model {args.model}: no such file or directory")
    if args.device != "auto":  # "auto" cannot fail; asking torch about CUDA costs the server's front end
        resolve_device(args.device)
    return engine_config(args)


def _add_fields(group, cls: type, prefix: str, names: tuple[str, ...] | None = None) -> None:
    """The flags of `cls`'s options (of those in `names` only, when given), in field order."""
    defaults, hints = cls(), get_type_hints(cls)
    for f in options(cls):
        if names is None or f.name in names:
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


# ---- LLM()'s keywords: EngineConfig's names, and vLLM's where tandem has their meaning ----

def llm_config(model: str | None, given: dict[str, Any]) -> EngineConfig:
    """The configuration of `LLM(model, **given)`: EngineConfig's fields by name (`launch` and
    `experiments` too); vLLM's engine arguments become the fields they mean (`VLLM_NAMES`),
    or, where tandem has no such option, are accepted at vLLM's default and refused otherwise."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = {k: v for k, v in given.items() if k in fields}
    for name in given.keys() - fields:
        for field_name, value in _vllm_setting(name, given[name], model).items():
            if field_name in settings:
                raise TypeError(f"LLM() got {name}={given[name]!r} and {field_name}={settings[field_name]!r}, "
                                "which set the same option; pass one")
            settings[field_name] = value
    return EngineConfig(model=model, **settings)


def _vllm_setting(name: str, value: Any, model: str | None) -> dict[str, Any]:
    if name in VLLM_NAMES:
        return VLLM_NAMES[name](value, model)
    if name in VLLM_WITHOUT_COUNTERPART:
        default, why = VLLM_WITHOUT_COUNTERPART[name]
        if value != default:
            raise ValueError(f"LLM({name}={value!r}): {why}")
        return {}
    known = [f.name for f in dataclasses.fields(EngineConfig)] + list(VLLM_NAMES)
    close = difflib.get_close_matches(name, known, 1)
    raise TypeError(f"LLM() got an unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))


def _trust_remote_code(value: Any, model: str | None) -> dict[str, Any]:
    if value:
        raise ValueError("LLM(trust_remote_code=True): tandem runs no code from model repositories; its "
                         "architectures (tandem.config.SUPPORTED_ARCHITECTURES) are built in")
    return {}


def _load_format(value: Any, model: str | None) -> dict[str, Any]:
    if value in ("auto", "dummy"):
        return {"dummy_weights": True} if value == "dummy" else {}
    raise ValueError(f"LLM(load_format={value!r}): tandem reads safetensors, GGUF and (allow_pickle=True) "
                     "pickle checkpoints by their files; load_format may be 'auto' or 'dummy' (random weights)")


def _runner(value: Any, model: str | None) -> dict[str, Any]:
    if value in ("auto", "generate"):
        return {}
    raise ValueError(f"{value!r}: tandem runs generative models only (runner/task 'auto' or 'generate')")


# vLLM's names for options tandem has: name -> (value, model) -> the EngineConfig fields it sets.
VLLM_NAMES: dict[str, Callable[[Any, str | None], dict[str, Any]]] = {
    "max_num_seqs": lambda v, _: {"max_running_requests": v},
    "enforce_eager": lambda v, _: {"cuda_graph": "off"} if v else {},
    # vLLM chunks long prompts by default; off means every prompt is prefilled whole.
    "enable_chunked_prefill": lambda v, _: {} if v is None or v else {"chunked_prefill_size": None},
    "load_format": _load_format,
    "trust_remote_code": _trust_remote_code,
    "runner": _runner,
    "task": _runner,
}

# vLLM's arguments tandem has nothing for: name -> (vLLM's default, why another value is refused).
# The default asks for nothing, so code that spells it out runs unchanged.
VLLM_WITHOUT_COUNTERPART: dict[str, tuple[Any, str]] = {
    "tokenizer_mode": ("auto", "tandem loads tokenizers with transformers' AutoTokenizer only"),
    "skip_tokenizer_init": (False, "tandem always loads the checkpoint's tokenizer"),
    "revision": (None, "tandem opens local checkpoints only; download that revision and pass its directory"),
    "tokenizer_revision": (None, "tandem opens local checkpoints only"),
    "download_dir": (None, "tandem downloads nothing; pass a local directory or .gguf file"),
    "hf_token": (None, "tandem downloads nothing; pass a local directory or .gguf file"),
    "hf_overrides": (None, "tandem reads config.json as it is"),
    "max_num_batched_tokens": (None, "tandem's nearest option is max_prefill_tokens (prefill tokens per "
                                     "step; decodes are not counted)"),
    "kv_cache_memory_bytes": (None, "size the KV pool with max_total_tokens (tokens) or gpu_memory_utilization"),
    "block_size": (None, "tandem's KV cache has no block size to set"),
    "swap_space": (4, "tandem keeps no KV swap space on the CPU"),
    "cpu_offload_gb": (0, "tandem keeps every weight on the device"),
    "pipeline_parallel_size": (1, "tandem has tensor parallelism only (tensor_parallel_size)"),
    "data_parallel_size": (1, "one LLM is one engine; `tandem serve --dp N` runs replicas"),
    "distributed_executor_backend": (None, "tandem starts its tensor-parallel ranks itself"),
    "disable_custom_all_reduce": (False, "tandem's all-reduce is torch.distributed's"),
    "max_logprobs": (20, "tandem's bound on logprobs is fixed at 20 (tandem.sampling.MAX_LOGPROBS)"),
    "disable_log_stats": (True, "tandem's LLM logs no statistics (engine.stats() returns them)"),
    "compilation_config": (None, "tandem compiles no graphs beyond CUDA graphs (cuda_graph)"),
    "enable_lora": (False, "tandem has no LoRA adapters"),
    "limit_mm_per_prompt": (None, "tandem runs text-only models"),
    "mm_processor_kwargs": (None, "tandem runs text-only models"),
}
