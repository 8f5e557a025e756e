"""The commands at the terminal (issue 24, item 7): every option of generate/chat/serve has a
help line and shows its default; `serve` refuses a taken port or a missing model path in
milliseconds with one line, before anything loads; `tandem chat` survives Ctrl-C during a
reply (that reply stops, the conversation goes on) and edits its input with readline."""
import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.entrypoints import cli
from tandem.sampling import SamplingParams
from tandem.server import cli as serve_cli
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved

REPO = Path(__file__).resolve().parents[1]


# ---- --help ----

@pytest.mark.parametrize("parser", [cli.generate_parser, cli.chat_parser, serve_cli.build_parser])
def test_every_option_has_a_help_line_that_shows_its_default(parser):
    ap = parser()
    for action in ap._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name} has no help"
        # An option that takes a value, or a --x/--no-x pair, says what holds without it
        # (a plain switch is off; a positional argument has none).
        if action.option_strings and (action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)):
            assert "default" in action.help, f"{name}: its help does not say its default"


def test_generate_help_renders_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert done.value.code == 0
    for shown in ("--max-tokens MAX_TOKENS tokens to generate at most (default: 128)", "(default: 0.7)",
                  "the text to continue", "--stop TEXT", "(default: derived from --seed)",
                  "--max-running-requests INT requests decoding at once (default: 256)"):
        assert shown in text, shown


# ---- serve: checks before anything loads ----

@pytest.fixture
def no_serving(monkeypatch):
    """A serve that gets past its checks fails the test: nothing may start."""
    def started(*a, **kw):
        raise AssertionError("serve went on to start the engine")
    monkeypatch.setattr(serve_cli, "_serve", started)


def _serve_fails(argv: list[str], capsys) -> str:
    began = time.perf_counter()
    rc = serve_cli.main(argv)
    took = time.perf_counter() - began
    err = capsys.readouterr().err
    assert rc == 2 and took < 0.5, (rc, took)
    assert len(err.splitlines()) == 1 and err.startswith("tandem serve: error: "), err
    return err


def test_serve_refuses_a_missing_model_path_at_once(tmp_path, capsys, no_serving):
    err = _serve_fails(["--model", str(tmp_path / "missing"), "--port", "0"], capsys)
    assert "missing: no such file or directory" in err


def test_serve_refuses_a_taken_port_at_once(capsys, no_serving):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _serve_fails(["--port", str(port)], capsys)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    serve_cli.check_port_free("127.0.0.1", port)  # free again: the check holds nothing


@pytest.mark.parametrize("argv,message", [(["--port", "70000"], "--port must be in [0, 65535]"),
                                          (["--dp", "0"], "--dp must be >= 1, got 0"),
                                          (["--max-model-len", "0"], "--max-model-len must be >= 1")])
def test_serve_refuses_bad_flags_in_one_line(capsys, no_serving, argv, message):
    assert message in _serve_fails(argv, capsys)


def test_the_command_prints_one_line_and_no_traceback(tmp_path):
    """The real command line, `python -m tandem serve`: the interpreter and imports are most of it."""
    r = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", str(tmp_path / "gone")],
                       capture_output=True, text=True, timeout=60, cwd=REPO,
                       # The repo first, and whatever else the caller's path has (the H200's wheels).
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"tandem serve: error: --model {tmp_path / 'gone'}: no such file or directory\n"


# ---- chat: Ctrl-C during a reply ----

@pytest.fixture
def engine(tiny_text_model):
    # Users' processes have Python's default SIGINT handler; a pytest-xdist worker ignores SIGINT
    # (its controller takes Ctrl-C), so the tests install the default for their duration.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT handlers can be set only in the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    from tandem.entrypoints.ranks import build_engine
    try:
        engine = build_engine(EngineConfig(model=str(tiny_text_model), device=TEST_DEVICE, max_model_len=512))
        yield engine
        engine.close()
    finally:
        signal.signal(signal.SIGINT, previous)


REPLY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
EARLIER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]


def _ctrl_c(engine, method: str, at_call: int, presses: int = 1) -> None:
    """Press Ctrl-C (SIGINT to this process) as `engine.<method>` is called the at_call-th time."""
    real, calls = getattr(engine, method), []

    def pressed(*args):
        calls.append(1)
        if len(calls) == at_call:
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)
        return real(*args)
    setattr(engine, method, pressed)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(engine):
    """The part of the reply already shown stays as the assistant's turn (llama.cpp's chat
    does the same); the request is cancelled and the next turn runs on the same engine."""
    messages = EARLIER + [{"role": "user", "content": "Tell me a story."}]
    out = io.StringIO()
    _ctrl_c(engine, "step", at_call=8)
    cli.chat_turn(engine, messages, REPLY, out)
    shown = out.getvalue()
    assert shown.endswith(" [stopped]")
    partial = shown.removesuffix(" [stopped]")
    assert messages[:3] == EARLIER + [{"role": "user", "content": "Tell me a story."}]
    assert messages[3] == {"role": "assistant", "content": partial} and len(messages) == 4
    assert partial and len(engine.tokenizer.encode(partial)) < REPLY.max_tokens  # stopped part-way
    assert not engine.has_unfinished() and not engine.requests
    assert_kv_conserved(engine)
    del engine.step  # the real one again
    messages.append({"role": "user", "content": "Go on."})
    after = io.StringIO()
    cli.chat_turn(engine, messages, REPLY, after)
    assert messages[-1] == {"role": "assistant", "content": after.getvalue()} and len(messages) == 6


def test_ctrl_c_before_any_text_drops_the_question(engine):
    """Nothing was said: the user's turn goes too, so no template meets two user turns in a row."""
    messages = EARLIER + [{"role": "user", "content": "Tell me a story."}]
    out = io.StringIO()
    _ctrl_c(engine, "has_unfinished", at_call=1)
    cli.chat_turn(engine, messages, REPLY, out)
    assert out.getvalue() == " [stopped]" and messages == EARLIER
    assert not engine.requests
    assert_kv_conserved(engine)


def test_a_second_ctrl_c_interrupts_at_once(engine):
    """Pressed twice, Ctrl-C is not held for the step's end: a plain KeyboardInterrupt, which
    ends the chat (the engine may be mid-step)."""
    messages = EARLIER + [{"role": "user", "content": "Tell me a story."}]
    _ctrl_c(engine, "step", at_call=3, presses=2)
    with pytest.raises(KeyboardInterrupt) as stopped:
        cli.chat_turn(engine, messages, REPLY, io.StringIO())
    assert not isinstance(stopped.value, cli.ReplyInterrupted)


def test_chat_input_edits_with_readline():
    pytest.importorskip("readline")
    sys.modules.pop("readline", None)
    cli._line_editing()
    assert "readline" in sys.modules
