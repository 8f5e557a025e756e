"""Grammar specs: cheap limits at submission (a length and a bracket scan, on the engine loop),
then parsed and compiled once per (kind, spec) in a thread pool, never on the engine loop."""
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter

import numpy as np

# Limits checked at submission without parsing: past them parsing alone could hold a thread
# for seconds (xgrammar's schema conversion grows about cubically with nesting).
MAX_SPEC_BYTES = 2**20  # 1 MiB: real tool sets and schemas are at most a few hundred KB
# JSON nesting levels: OpenAI allows 10 schema levels (~20); 128 parse in ~50 ms, 400 in ~1.6 s.
MAX_SCHEMA_DEPTH = 128

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# A native library's source location in its messages ("[13:59:27] /project/cpp/x.cc:820: ").
_NATIVE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")

_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
         "choice": "choice list"}


class InvalidGrammar(ValueError):
    """The spec itself is wrong (the request's fault: a 400); found while parsing or compiling."""


class GrammarUnavailable(RuntimeError):
    """Structured output cannot run here (xgrammar missing, the tokenizer unsupported): a 500."""


def _choice_ebnf(spec: str) -> str:
    # JSON string escapes are valid EBNF string escapes for xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))


def json_depth(text: str) -> int:
    """Deepest bracket nesting of valid JSON text by bytes operations and a numpy cumsum, no
    parse: ~10 ms a MiB. Escapes go first (backslashes pair up left to right, as JSON reads
    them), then strings (every other piece between quotes), then all but the brackets."""
    raw = text.encode("utf-8", "surrogatepass").replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(raw.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((codes == ord("{")) | (codes == ord("[")), 1, -1)).max())


def check_limits(kind: str, spec: str) -> None:
    """Cheap enough for the engine loop: ValueError naming the field for an oversized spec."""
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"{kind} is {size} bytes; the limit is {MAX_SPEC_BYTES} bytes")
    if kind == "json_schema":
        depth = json_depth(spec)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{kind} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH} "
                             "levels of JSON objects and arrays")


def _invalid(kind: str, error: Exception) -> InvalidGrammar:
    """xgrammar's message, last line, without its C++ source location."""
    text = str(error).strip()
    reason = _NATIVE_LOCATION.sub("", text.splitlines()[-1]) if text else type(error).__name__
    return InvalidGrammar(f"{kind} is not a valid {_WHAT[kind]}: {reason}")


def check_spec(kind: str, spec: str) -> None:
    """The limits, then a parse (tokenizer-independent): ValueError naming the field if bad.
    Not for the engine loop (a parse under the limits still takes up to ~0.1 s)."""
    check_limits(kind, spec)
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(_choice_ebnf(spec) if kind == "choice" else spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _invalid(kind, e) from None


def _xgr_compile(compiler, kind: str, spec: str):
    """The compilation itself, in a pool thread (xgrammar releases the GIL while it runs)."""
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(_choice_ebnf(spec) if kind == "choice" else spec)


def _xgr_compiler(tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's import and the tokenizer info (0.7-7 s), in a thread of its own at start-up."""
    import xgrammar as xgr

    # The mask spans the model's logits, which may be wider than the tokenizer.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    return xgr.GrammarCompiler(info, max_threads=2)


def _prepare(result: Future, *args) -> None:
    try:
        result.set_result(_xgr_compiler(*args))
    except BaseException as e:  # reported to each compilation that needs it
        result.set_exception(e)


class Compilation:
    """One (kind, spec)'s compilation: its future, and when a pool thread began compiling it
    (the time limit's clock: neither the queue nor xgrammar's preparation counts)."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self.started: float | None = None  # perf_counter(), set by the pool thread

    def running_for(self, now: float) -> float:
        return 0.0 if self.started is None else now - self.started


class GrammarCompiler:
    """xgrammar's compiler over the engine's tokenizer. Compilations are cached by (kind, spec),
    so concurrent requests with one schema share one; failed ones are retried unless the spec
    itself was invalid. The first compilation starts a thread that prepares xgrammar (ending
    when done): an engine that never sees a grammar never pays for it; the pool starts on demand."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], threads: int = 2,
                 max_entries: int = 512) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tandem-grammar")
        self._cache: OrderedDict[tuple[str, str], Compilation] = OrderedDict()
        self._max_entries = max_entries
        self._prepared: Future = Future()  # a compilation waits for it in the pool, not on the loop
        self._preparation = threading.Thread(target=_prepare, args=(self._prepared, tokenizer, vocab_size,
                                                                    stop_ids), name="tandem-grammar-prepare")
        self._preparing = threading.Lock()

    def prepare(self) -> None:
        """Start xgrammar's preparation (idempotent). On demand, not with the engine: its
        vocabulary scan holds the GIL, which stretched start-up beside graph capture (17.0 ->
        20.7 s on the H200) and, begun after warm-up, the first seconds of serving (GPU busy
        0.97 -> 0.84 in an 8.6 s benchmark)."""
        with self._preparing:
            if self._preparation.ident is None:
                self._preparation.start()

    def submit(self, kind: str, spec: str) -> Compilation:
        self.prepare()  # the first grammar starts the preparation; its compilation waits for it
        key = (kind, spec)
        job = self._cache.get(key)
        if job is None or _retry(job.future):
            job = Compilation()
            job.future = self._pool.submit(self._compile, job, kind, spec)
            self._cache[key] = job
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return job

    def _compile(self, job: Compilation, kind: str, spec: str):
        try:
            compiler = self._prepared.result()
        except Exception as e:
            raise GrammarUnavailable(f"structured output is unavailable: {type(e).__name__}: {e}") from e
        job.started = perf_counter()
        try:
            return _xgr_compile(compiler, kind, spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse or compile refused it
            raise _invalid(kind, e) from None

    def shutdown(self) -> None:
        """Queued compilations are cancelled; a running one (and the preparation) runs to its end."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _retry(fut: Future) -> bool:
    """A cached future worth submitting again: cancelled, or failed for a reason other than the spec."""
    if fut.cancelled():
        return True
    return fut.done() and fut.exception() is not None and not isinstance(fut.exception(), InvalidGrammar)
