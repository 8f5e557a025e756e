"""Engine options come from the configuration once, for every entry point (issue 17, item 1):
no flags gives exactly `EngineConfig()`, booleans go both ways, `--help` shows real defaults,
and what is not a user knob (experiments, debug checks, launch outside `serve`) is no flag."""
import argparse
import dataclasses
from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from tandem import LLM, options
from tandem.config import EngineConfig, Experiments
from tandem.diagnostics.debug_checks import DebugChecks
from tandem.distributed.launch import Launch
from tandem.entrypoints import cli as entry
from tandem.server import cli as serve_cli

# Each command's parser and the arguments it needs besides engine options.
COMMANDS = {"serve": (serve_cli.build_parser, []), "generate": (entry.generate_parser, ["hi"]),
            "chat": (entry.chat_parser, [])}


def _config(command: str, *flags: str) -> EngineConfig:
    make, needed = COMMANDS[command]
    args = make().parse_args([*needed, *flags])
    # What each command's main builds its engine from.
    return options.engine_config(args) if command == "serve" else entry.engine_config(args)


def _flags(command: str) -> set[str]:
    return {s for a in COMMANDS[command][0]()._actions for s in a.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_give_exactly_the_default_configuration(command):
    cfg, default = _config(command), EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert getattr(cfg, f.name) == getattr(default, f.name), f.name
    assert cfg == default


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_real_defaults(command):
    text = " ".join(COMMANDS[command][0]().format_help().split())  # not wrapped
    assert "_MISSING_TYPE" not in text and " object at 0x" not in text
    assert "(default: 8192)" in text and "(default: auto)" in text  # max_prefill_tokens, dtype


@pytest.mark.parametrize("command", COMMANDS)
def test_every_knob_is_a_flag_and_booleans_go_both_ways(command):
    hints = get_type_hints(EngineConfig)
    for f in options.options(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in _flags(command), flag
        if hints[f.name] is bool:
            assert getattr(_config(command, flag), f.name) is True, flag
            assert getattr(_config(command, "--no-" + flag[2:]), f.name) is False, flag


@pytest.mark.parametrize("command", COMMANDS)
def test_fixed_sets_are_choices(command):
    for f in options.options(EngineConfig):
        hint = get_type_hints(EngineConfig)[f.name]
        members = (hint,) if get_origin(hint) is Literal else get_args(hint)  # X or a union
        literal = next((k for k in members if get_origin(k) is Literal), None)
        if literal is not None:
            (action,) = [a for a in COMMANDS[command][0]()._actions if a.dest == f.name]
            assert set(get_args(literal)) <= set(action.choices), f.name
    with pytest.raises(SystemExit):
        _config(command, "--dtype", "float8")


@pytest.mark.parametrize("command", COMMANDS)
def test_experiments_debug_checks_and_dead_fields_are_no_flags(command):
    flags = _flags(command)
    names = [f.name for f in dataclasses.fields(Experiments)] + ["debug_future_map", "debug_prefix_cache",
                                                                 "extra", "experiments", "launch"]
    for name in names:
        assert "--" + name.replace("_", "-") not in flags and "--no-" + name.replace("_", "-") not in flags
    assert not hasattr(EngineConfig(), "extra")
    launch_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Launch)}
    assert launch_flags <= flags if command == "serve" else not launch_flags & flags


def test_spellings_users_know_still_work():
    cfg = _config("serve", "--no-prefix-caching", "--tp", "2", "--disable-overlap", "--dummy-weights",
                  "--max-total-tokens", "64", "--chunked-prefill-size", "none", "--timeline", "steps.jsonl",
                  "--enable-mixed-batch", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500")
    assert (cfg.enable_prefix_caching, cfg.tensor_parallel_size, cfg.disable_overlap, cfg.dummy_weights) == \
        (False, 2, True, True)
    assert (cfg.max_total_tokens, cfg.chunked_prefill_size, cfg.timeline, cfg.enable_mixed_batch) == \
        (64, None, "steps.jsonl", True)
    assert cfg.launch == Launch(nnodes=2, node_rank=1, master_port=29500)
    gen = _config("generate", "--tp", "2", "--no-prefix-caching", "--quantization", "fp8", "--timeline", "t.jsonl")
    assert (gen.tensor_parallel_size, gen.enable_prefix_caching, gen.quantization, gen.timeline) == \
        (2, False, "fp8", "t.jsonl")


def test_kv_cache_dtype_is_a_flag_of_every_command_an_llm_keyword_and_vllms_name(capsys):
    for command in COMMANDS:
        assert _config(command, "--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        _config("generate", "--kv-cache-dtype", "fp8_e5m2")
    err = capsys.readouterr().err  # argparse names the choices (quoted or not, by Python version)
    assert "--kv-cache-dtype: invalid choice: 'fp8_e5m2'" in err and "fp8_e4m3" in err
    # vLLM calls it the same: LLM(kv_cache_dtype=...) sets the field (no longer refused).
    assert options.llm_config(None, {"kv_cache_dtype": "fp8_e4m3"}).kv_cache_dtype == "fp8_e4m3"
    assert "kv_cache_dtype" not in options.VLLM_WITHOUT_COUNTERPART
    # Commands with parsers of their own (bench latency, decode_kernels) take the same flag.
    own = argparse.ArgumentParser()
    options.add_engine_fields(own, "kv_cache_dtype")
    assert own.parse_args([]).kv_cache_dtype == "auto" and own.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert own._actions[-1].choices == _flag_action("serve", "--kv-cache-dtype").choices


def _flag_action(command: str, flag: str) -> argparse.Action:
    return next(a for a in COMMANDS[command][0]()._actions if flag in a.option_strings)


def test_the_server_records_a_bounded_timeline_and_keeps_a_path():
    args = serve_cli.build_parser().parse_args(["--timeline", "steps.jsonl", "--api-key", "k"])
    info = serve_cli.server_info(args, options.engine_config(args))
    assert info["server_args"]["api_key"] == "<redacted>" and info["engine_config"]["timeline"] == "steps.jsonl"
    assert "max_total_tokens" not in info["server_args"]  # engine options are reported once, as config


def test_llm_takes_the_same_options_and_names_a_typo():
    with pytest.raises(TypeError, match="unknown option 'dtyp'; did you mean 'dtype'"):
        LLM(dtyp="float32")
    with pytest.raises(TypeError, match="unknown option 'debug_future_map'"):
        LLM(debug_future_map=True)  # a debug check: TANDEM_DEBUG_FUTURE_MAP=1


def test_debug_checks_come_from_the_environment():
    assert DebugChecks.from_env({}) == DebugChecks()
    on = DebugChecks.from_env({"TANDEM_DEBUG_FUTURE_MAP": "1", "TANDEM_DEBUG_PREFIX_CACHE": "1"})
    assert on.future_map and on.prefix_cache


def test_bool_or_path_options_parse_a_path():
    ap = argparse.ArgumentParser()
    options.add_engine_options(ap)
    assert options.engine_config(ap.parse_args(["--timeline", "x.jsonl"])).timeline == "x.jsonl"


def test_experiment_overrides_parse_switches_and_reject_unknown_names():
    from tandem.config import Experiments
    exp = Experiments.from_overrides(["fused_kv_write=off", "cascade_attention=auto", "grammar_overlap=1",
                                      "host_kv_prefetch_requests=16"])
    assert (exp.fused_kv_write, exp.cascade_attention, exp.grammar_overlap) == (False, "auto", True)
    assert exp.host_kv_prefetch_requests == 16
    from tandem.memory.prefix_cache import PREFETCH_REQUESTS
    assert Experiments().host_kv_prefetch_requests == PREFETCH_REQUESTS  # one default, stated twice
    from tandem.prefill_graphs import LARGEST_BUCKET
    assert Experiments().prefill_graph_max_tokens == LARGEST_BUCKET  # one default, stated twice
    assert Experiments.from_overrides([]) == Experiments()
    for bad in (["no_such_switch=on"], ["fused_kv_write"], ["fused_kv_write=maybe"], ["host_kv_prefetch_requests=x"]):
        with pytest.raises(ValueError, match="--experiment"):
            Experiments.from_overrides(bad)
