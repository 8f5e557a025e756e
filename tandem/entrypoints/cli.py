"""The `tandem` command: generate, chat, serve, bench, profile, sync-audit."""
import argparse
import atexit
import importlib
import logging
import os
import sys

from tandem import options
from tandem.chat_template import render_chat
from tandem.config import EngineConfig
from tandem.entrypoints.interrupts import HeldInterrupt, interrupts_between_steps

_EXAMPLES = {
    "generate": """examples:
  tandem generate "Once upon a time"                      # built-in SmolLM2-135M, streamed
  tandem generate "def fib(n):" --temperature 0 --max-tokens 64
  tandem generate "Hello" --model ~/models/Qwen3-0.6B --device cuda --dtype bfloat16
  tandem generate "Hi" --stop "." --sample-seed 7 --verbose""",
    "chat": """examples:
  tandem chat                                             # built-in model, empty line quits
  tandem chat --system "Answer in one sentence." --temperature 0.3""",
}


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    options.add_engine_options(ap)
    ap.add_argument("--launch-blocking", action="store_true",
                    help="CUDA_LAUNCH_BLOCKING=1: errors at the failing launch (timings meaningless)")
    ap.add_argument("--sync-audit", action="store_true",
                    help="report every host sync inside the engine loop (CUDA)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log engine progress")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config, checked before anything heavy loads (`options.checked_engine_config`)."""
    cfg = options.checked_engine_config(args)
    if args.launch_blocking:  # before CUDA starts: it is read at context creation
        from tandem.diagnostics.errors import enable_launch_blocking
        enable_launch_blocking()
    return cfg


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("sampling", "the fields of tandem.sampling.SamplingParams")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.7,
                       help="0 is greedy; higher is more random (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample from the smallest set of tokens with this much probability (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1,
                       help="sample from the k likeliest tokens; -1: all (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this times the likeliest (default: %(default)s)")
    group.add_argument("--sample-seed", type=int, metavar="SEED",
                       help="this request's sampling seed (default: derived from --seed)")
    group.add_argument("--stop", action="append", metavar="TEXT",
                       help="stop when this text is generated; repeatable (default: none)")


def sampling_params(args: argparse.Namespace):
    from tandem.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, stop=args.stop)


class ReplyInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a reply at a step's end: its request is cancelled and the engine is ready
    for the next one. `text`: what had been written."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


def stream(engine, prompt: str | list[int], params, out=sys.stdout) -> str:
    """Run one request to the end, writing its text as it is generated. Ctrl-C cancels it at
    the next step's end (ReplyInterrupted); a second Ctrl-C interrupts the step itself (a plain
    KeyboardInterrupt: the engine's state is then unknown)."""
    rid = engine.add_request(prompt, params)
    text = []
    try:
        with interrupts_between_steps() as check_interrupt:
            while engine.has_unfinished():
                check_interrupt()
                text += _step_text(engine, rid, out)
    except HeldInterrupt:
        engine.cancel([rid])
        raise ReplyInterrupted("".join(text)) from None
    engine.release(rid)
    return "".join(text)


def _step_text(engine, rid: str, out) -> list[str]:
    text = []
    for delta in engine.step():
        if delta.request_id == rid and delta.new_text:
            out.write(delta.new_text)
            out.flush()
            text.append(delta.new_text)
    return text


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"tandem {command}", description=description,
                                   epilog=_EXAMPLES[command],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def generate_parser() -> argparse.ArgumentParser:
    ap = _parser("generate", "Generate text from a prompt, streamed.")
    ap.add_argument("prompt", help="the text to continue")
    add_engine_args(ap)
    add_sampling_args(ap)
    return ap


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    _logging(args.verbose)
    params, cfg = sampling_params(args), engine_config(args)  # both checked before the model loads
    from tandem.entrypoints.ranks import build_engine
    engine = build_engine(cfg)
    sys.stdout.write(args.prompt)
    if not args.sync_audit:
        stream(engine, args.prompt, params)
        sys.stdout.write("\n")
        return 0
    from tandem.diagnostics.sync_audit import SyncAudit
    with SyncAudit() as audit:
        stream(engine, args.prompt, params)
    sys.stdout.write("\n")
    report = audit.report()
    print(report.format(), file=sys.stderr)
    return 1 if report.total else 0


def chat_parser() -> argparse.ArgumentParser:
    ap = _parser("chat", "Interactive chat (empty line or Ctrl-D quits; Ctrl-C stops a reply).")
    ap.add_argument("--system", help="system prompt (default: none)")
    add_engine_args(ap)
    add_sampling_args(ap)
    return ap


def chat_main(argv: list[str]) -> int:
    args = chat_parser().parse_args(argv)
    _logging(args.verbose)
    params, cfg = sampling_params(args), engine_config(args)  # both checked before the model loads
    from tandem.entrypoints.ranks import build_engine
    engine = build_engine(cfg)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    _line_editing()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        sys.stdout.write("assistant> ")
        chat_turn(engine, messages, params)
        sys.stdout.write("\n")
    return 0


def chat_turn(engine, messages: list[dict], params, out=sys.stdout) -> None:
    """Answer `messages` (the user's turn last), streaming the reply to `out` and appending it.
    Ctrl-C stops the reply: as in llama.cpp's chat, the part already shown stays in the
    conversation as the assistant's turn; stopped before any text, the user's turn goes too
    (many templates refuse two user turns in a row)."""
    ids = render_chat(engine.tokenizer, messages)
    try:
        reply = stream(engine, ids, params, out)
    except ReplyInterrupted as stopped:
        out.write(" [stopped]")
        if not stopped.text:
            messages.pop()
            return
        reply = stopped.text
    messages.append({"role": "assistant", "content": reply})


def _line_editing() -> None:
    """input() edits with readline where Python has it: arrows, history, Ctrl-R."""
    try:
        import readline  # noqa: F401 (importing it is what turns it on)
    except ImportError:  # Windows without pyreadline
        pass


def bench_main(argv: list[str]) -> int:
    kinds = {"latency": "tandem.bench.latency:main", "offline": "tandem.bench.offline:main",
             "serve": "tandem.bench.serve:bench_serve_main", "prefix": "tandem.bench.prefix:main",
             "grammar": "tandem.bench.grammar:main", "soak": "tandem.bench.soak:main",
             "suite": "tandem.bench.suite:main", "wheels": "tandem.bench.wheels:main",
             "spec-verify": "tandem.bench.spec_verify:main", "spec": "tandem.bench.spec_tasks:main",
             "spec-steps": "tandem.bench.spec_steps:main", "truncated-draft": "tandem.bench.truncated_draft:main",
             "spec-overlap": "tandem.bench.spec_overlap:main", "host-steps": "tandem.bench.host_steps:main",
             "tier-replay": "tandem.bench.tier_replay:main"}
    if not argv or argv[0] not in kinds:
        print(f"usage: tandem bench {{{','.join(kinds)}}} [options]", file=sys.stderr)
        return 2
    return _call(kinds[argv[0]], argv[1:])


COMMANDS = {
    "generate": "tandem.entrypoints.cli:generate_main",
    "chat": "tandem.entrypoints.cli:chat_main",
    "serve": "tandem.server:serve_main",
    "bench": "tandem.entrypoints.cli:bench_main",
    "profile": "tandem.diagnostics.profile:profile_main",
    "sync-audit": "tandem.diagnostics.sync_audit:sync_audit_main",
}


def _call(target: str, argv: list[str]) -> int:
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: tandem {" + ",".join(COMMANDS) + "} [options]\n\n"
              "  generate    generate text from a prompt, streamed to the terminal\n"
              "  chat        interactive chat on the same engine\n"
              "  serve       OpenAI-compatible HTTP server\n"
              "  bench       benchmarks: latency | offline | serve | prefix | grammar | soak | suite | spec-verify | spec | spec-steps | spec-overlap | truncated-draft | host-steps | tier-replay\n"
              "  profile     traces and a timeline plot, overlap on vs off\n"
              "  sync-audit  find host syncs in the engine loop (CUDA)\n\n"
              "examples:\n"
              "  tandem generate \"Once upon a time\" --max-tokens 32\n"
              "  tandem serve --port 8000            # then: OpenAI clients at http://127.0.0.1:8000/v1\n"
              "  tandem bench offline --help\n\n"
              "'tandem COMMAND --help' lists a command's options.",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return _call(COMMANDS[argv[0]], argv[1:])
    except (ValueError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        print(f"tandem {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user's wish, not a crash (the shell's 128 + SIGINT)
        print(f"\ntandem {argv[0]}: interrupted", file=sys.stderr)
        return 130


def exit_quietly(code: int) -> int:
    """End the process without interpreter teardown once Triton is loaded: its nanobind
    bindings print a 'leaked N types / functions' report there (objects its caches hold at
    exit, not an error of ours), which reads like a crash. atexit handlers still run and
    output is flushed, so nothing a user needs is lost; the exit code is kept."""
    if "triton" not in sys.modules:
        return code
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def console_main() -> int:
    """The `tandem` console script and `python -m tandem`."""
    return exit_quietly(main())


if __name__ == "__main__":
    raise SystemExit(console_main())
