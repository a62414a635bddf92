"""`StructuredOutputManager`: one per engine (one tokenizer). Turns `StructuredOutputsParams` into an
llguidance grammar and compiles it against the tokenizer when the request arrives, off the engine
thread (a bad schema, regex or grammar is a `ParameterError` naming the field, before anything is
queued), caches the compiled matcher by constraint, and gives each request a `GrammarState`: a
copy of the cached matcher (~0.1 ms, where compiling a large grammar takes up to a second).

Compilation is bounded twice: llguidance's own resource limits (`LIMITS`: grammar size, lexer
states and the work per mask) refuse grammars too large to serve, and `compile_timeout` refuses
one that takes longer than that to compile (the request gets its 400 then; llguidance finishes
the abandoned compile in the background within its limits).

A `GrammarState` lives with the request's sampling state: it survives preemption (the tokens it
accepted are the request's output, which a recomputed request keeps) and prefix-cache hits (only
prompt blocks are shared; the grammar starts at the first output token either way).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from llmserve.errors import ParameterError
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.ll_tokenizer import build_ll_tokenizer
from llmserve.tokenizer import Tokenizer

# JSON is generated compact, with json.dumps' separators: no free whitespace between tokens, where
# a small model can loop (llguidance's default allows any run of whitespace there).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PARAM = "structured_outputs"  # the server renames it to the field the constraint came in

LIMITS = llguidance.LLParserLimits(
    max_grammar_size=500_000,  # symbols in the grammar's productions
    initial_lexer_fuel=1_000_000,  # lexer construction at compile time (~20 ms of work)
    step_lexer_fuel=200_000,  # lexer work per token mask (~15 ms)
    step_max_items=50_000,  # parser items per token mask (~2.5 ms)
    max_lexer_states=250_000,  # ~1-2 kB each
)
"""llguidance's resource limits (its defaults, stated here so they are ours to change): a grammar
past them fails to compile, or fails its request at the step that exceeds them."""

DEFAULT_COMPILE_TIMEOUT = 10.0
"""Seconds a constraint may take to compile before its request is refused."""


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("kind", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str) -> None:
        self.matcher, self.kind = matcher, kind

    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        """Write the tokens allowed next into `mask_row` ([W] int32, contiguous, CPU)."""
        self.matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), mask_row.numel() * 4)

    def accept(self, token: int) -> None:
        """Advance past a sampled token. A token the mask forbade cannot come here; if one does
        (EOS forced by max_tokens is not sampled), the matcher enters its error state and
        allows EOS only from then on."""
        self.matcher.consume_token(token)

    def accept_all(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.accept(t)

    @property
    def is_finished(self) -> bool:
        return self.matcher.is_stopped()


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = 512,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None  # built on first use (~0.1-1 s)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # cache_key -> fresh matcher
        self._cache_size = cache_size
        self.compile_timeout = compile_timeout
        self._compiler: ThreadPoolExecutor | None = None
        # compile() runs on the server's input threads, new_state() in the engine thread
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = build_ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of `params`' grammar (cached; copy it before advancing it);
        ParameterError when the constraint is invalid, too large, or slower than
        `compile_timeout` to compile."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(2, thread_name_prefix="llmserve-grammar-compile")
            compiler = self._compiler
        tokenizer = self.ll_tokenizer
        grammar = _to_grammar(params)
        job = compiler.submit(llguidance.LLMatcher, tokenizer, grammar, log_level=0, limits=LIMITS)
        try:
            matcher = job.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise ParameterError(
                f"structured_outputs.{params.kind} took longer than {self.compile_timeout:g} s to compile",
                param=_PARAM,
            ) from None
        if matcher.is_error():
            raise ParameterError(
                f"invalid structured_outputs.{params.kind}: {matcher.get_error().strip()[:500]}",
                param=_PARAM,
            )
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(params).deep_copy(), params.kind)


def _to_grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ParameterError(
                    f"structured_outputs.json is not valid JSON: {e}", param=_PARAM
                ) from None
        if not isinstance(schema, dict):
            raise ParameterError("structured_outputs.json must be a JSON schema object", param=_PARAM)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ParameterError(f"invalid structured_outputs.json: {e}", param=_PARAM) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    if kind == "choice":
        # Lark string literals are JSON strings: each choice exactly, any characters escaped.
        alternatives = " | ".join(json.dumps(c) for c in params.choice or [])
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    text = params.grammar or ""
    if "::=" in text:  # llama.cpp's GBNF
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises its own parse errors
            raise ParameterError(f"invalid structured_outputs.grammar (GBNF): {e}", param=_PARAM) from None
    return llguidance.LLMatcher.grammar_from_lark(text)
