"""Grammar specs: checked at submission, compiled once per (kind, spec) in a thread pool."""
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor


def _choice_ebnf(spec: str) -> str:
    # JSON string escapes are valid EBNF string escapes for xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))


def check_spec(kind: str, spec: str) -> None:
    """Parse the spec (tokenizer-independent, fast); ValueError naming the field if it is bad."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(_choice_ebnf(spec) if kind == "choice" else spec)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{kind} is not a valid {_WHAT[kind]}: {reason}") from None


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
         "choice": "choice list"}


class GrammarCompiler:
    """xgrammar's compiler over the engine's tokenizer. Futures are cached by (kind, spec), so
    concurrent requests with one schema share one compilation; failed ones are retried."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], threads: int = 2,
                 max_entries: int = 512) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tandem-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()  # guards the lazily built xgrammar compiler
        self._xgr_compiler = None

    def submit(self, kind: str, spec: str) -> Future:
        key = (kind, spec)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self._compile, kind, spec)
            self._cache[key] = fut
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return fut

    def _compile(self, kind: str, spec: str):
        compiler = self._compiler()
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_grammar(_choice_ebnf(spec) if kind == "choice" else spec)

    def _compiler(self):
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                # The mask spans the model's logits, which may be wider than the tokenizer.
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._xgr_compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
