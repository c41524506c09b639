"""Grammars from constraints, and their compilation against the tokenizer: off the step loop
(a worker pool), cached by constraint (bounded, least recently used first out).

Building the grammar (`grammar_of`) is fast and is how a request is validated at the edge;
compiling it (the per-token tables, the slow part) runs on a worker thread — xgrammar releases
the GIL there — so the step loop keeps running while a request waits for its grammar."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from backend_engine.errors import InvalidRequestError
from backend_engine.structured.params import StructuredOutputsParams

# Pretty JSON (disable_any_whitespace off): a gap between tokens holds at most a space, or a
# newline and this much indentation (llama.cpp's rule), so a model cannot loop on blank lines.
MAX_JSON_INDENT = 16
log = logging.getLogger("kvgate.engine")
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def clean_error(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


# xgrammar (0.2.x) writes length-bounded JSON strings with this character class, which lets raw
# control characters (a tab, U+0000...) into a string, where JSON forbids them; its unbounded
# strings use the right class. Grammars with JSON in them are rewritten with the right one.
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


# JSON grammars are built with xgrammar's unbounded gaps (the one spelling every JSON grammar,
# structural tags included, prints), then each gap is rewritten to the whitespace policy.
_GAP = "[ \\n\\r\\t]*"
_GAP_RULE = "kvgate_json_gap"


# xgrammar (0.2.x) prints a code point below U+0100 as \xHH but reads \x with every hex digit
# that follows, so "é" then "a" printed as "\xe9a" reads back as U+0E9A. Before a printed
# grammar is read back, each \xHH becomes \u00HH (\u takes exactly four digits).
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[\s\S])")


def _unambiguous_escapes(text: str) -> str:
    return _ESCAPE.sub(lambda m: "\\u00" + m[1][1:] if m[1][0] == "x" and len(m[1]) == 3
                       else m[0], text)


def tightened(grammar: xgr.Grammar, disable_any_whitespace: bool = True) -> xgr.Grammar:
    """The JSON grammar with strings held to JSON's characters and its gaps to the whitespace
    policy: none (compact, as OpenAI's structured outputs write JSON) or, with
    `disable_any_whitespace` off, at most a space or a newline and MAX_JSON_INDENT of
    indentation."""
    text = str(grammar)
    new = text.replace(_LOOSE_CHARS, _JSON_CHARS)
    if _GAP in new:
        if disable_any_whitespace:
            new = new.replace(_GAP, '""')
        else:
            new = (new.replace(_GAP, _GAP_RULE)
                   + f'\n{_GAP_RULE} ::= "" | " " | "\\n" [ \\t]{{0, {MAX_JSON_INDENT}}}\n')
    if new == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(_unambiguous_escapes(new))
    except RuntimeError:  # never seen: with the escapes above, it reads back what it printed
        log.warning("could not tighten the JSON in a grammar; using it as built")
        return grammar


def _schema_text(params: StructuredOutputsParams) -> str:
    try:
        json.loads(params.spec_text)
    except ValueError as exc:
        raise InvalidRequestError(f"Invalid JSON schema: not JSON ({exc})", param=params.param,
                                  code="invalid_value") from None
    return params.spec_text


def grammar_of(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of a constraint; InvalidRequestError (naming the field) if it has none."""
    grammar = _build(params)
    if params.kind not in _WITH_JSON:
        return grammar
    return tightened(grammar, params.disable_any_whitespace)


_WITH_JSON = ("json", "json_object", "structural_tag")


def _build(params: StructuredOutputsParams) -> xgr.Grammar:
    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(_schema_text(params), any_whitespace=True,
                                                strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}),
                                                any_whitespace=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(params.spec_text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                "choice": "choice list", "json_object": "JSON grammar",
                "structural_tag": "tool-call format (a function's parameters)"}[kind]
        raise InvalidRequestError(f"Invalid {what}: {clean_error(exc)}", param=params.param,
                                  code="invalid_value") from None
    except RecursionError:
        raise InvalidRequestError(f"The {kind} is nested too deeply", param=params.param,
                                  code="invalid_value") from None


class GrammarCompilerPool:
    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], max_cached: int = 256,
                 num_threads: int = 1, on_compiled: Callable[[float], None] | None = None):
        self._tokenizer_info = tokenizer_info  # built lazily, on the worker (it is slow to build)
        self._compiler: xgr.GrammarCompiler | None = None
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvgate-grammar")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._grammars: OrderedDict[tuple[str, str], xgr.Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.on_compiled = on_compiled

    def grammar(self, params: StructuredOutputsParams) -> xgr.Grammar:
        """grammar_of, remembered: a request is validated on arrival, then compiled."""
        with self._lock:
            grammar = self._grammars.get(params.key)
            if grammar is not None:
                self._grammars.move_to_end(params.key)
                return grammar
        grammar = grammar_of(params)  # outside the lock: it may take a while for large schemas
        with self._lock:
            self._grammars[params.key] = grammar
            while len(self._grammars) > self.max_cached:
                self._grammars.popitem(last=False)
        return grammar

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar (a future), from the cache or from a new compilation."""
        with self._lock:
            future = self._futures.get(params.key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._futures.move_to_end(params.key)
                return future
            future = self._executor.submit(self._compile, params)
            self._futures[params.key] = future
            while len(self._futures) > self.max_cached:
                self._futures.popitem(last=False)  # in-flight ones stay referenced by requests
            return future

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1,
                                                 cache_enabled=False)
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(self.grammar(params))
        if self.on_compiled is not None:
            self.on_compiled(time.perf_counter() - start)
        return compiled

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
