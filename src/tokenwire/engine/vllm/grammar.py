"""Structured outputs on vLLM's engine: tokenwire's grammars, applied in vLLM's worker.

vLLM's own structured outputs need its tokenizer, which tokenwire turns off (it renders and
decodes itself: ``skip_tokenizer_init``). So the frontend compiles a constraint as it does for
the hf engine (``tokenwire.structured``) and sends the grammar's text with the request
(``SamplingParams.extra_args``); ``GrammarLogitsProcessor``, which vLLM loads in its worker,
keeps one llguidance matcher per constrained request, advanced by the request's own output ids,
and sets every id the grammar does not allow to -inf. vLLM takes raw logprobs before logits
processors and processed ones after, so a constrained token's logprob follows
``--logprobs-mode`` as on the hf engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from tokenwire.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarState
from tokenwire.structured.masks import mask_bias

# SamplingParams.extra_args key: {"text": llguidance grammar, "end_ids": ids that end a choice}.
GRAMMAR_ARG = "tokenwire_grammar"
_CACHE_SIZE = 64


def grammar_args(grammar: CompiledGrammar) -> dict[str, Any]:
    """What a request carries to the worker for ``grammar``."""
    return {GRAMMAR_ARG: {"text": grammar.text, "end_ids": sorted(grammar.end_ids)}}


@dataclass(slots=True)
class _Row:
    state: GrammarState
    output_ids: list[int]  # vLLM's live list of the request's output ids
    seen: int = 0  # how many of them the state has accepted

    def catch_up(self) -> None:
        ids = self.output_ids
        while self.seen < len(ids) and ids[self.seen] >= 0:  # -1: not copied back yet
            self.state.accept(ids[self.seen])
            self.seen += 1


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks the logits of requests that carry a grammar; others are never touched."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        model = vllm_config.model_config
        self._tokenizer_dir = model.tokenizer
        self._vocab_size = model.get_vocab_size()
        self._device = device
        self._compiler: GrammarCompiler | None = None
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            spec = (params.extra_args or {}).get(GRAMMAR_ARG)
            if spec is None:
                self._rows.pop(index, None)
            else:
                self._rows[index] = _Row(self._grammar(spec).new_state(), output_ids)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self._rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        indices = sorted(self._rows)
        words = []
        for index in indices:
            row = self._rows[index]
            row.catch_up()
            words.append(row.state.bitmask())
        vocab = self._vocab_size
        bias = mask_bias(np.stack(words), vocab).to(logits.device, logits.dtype)
        logits[indices, :vocab] += bias
        logits[indices, vocab:] = float("-inf")  # padding past the vocabulary, if any
        return logits

    def _grammar(self, spec: dict[str, Any]) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (compiled here once per text: the frontend's
        compile of the same text already succeeded, so this one does too)."""
        text = spec["text"]
        grammar = self._grammars.get(text)
        if grammar is None:
            grammar = self._compiler_for(spec["end_ids"]).compile_text(text)
            self._grammars[text] = grammar
            if len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(text)
        return grammar

    def _compiler_for(self, end_ids: list[int]) -> GrammarCompiler:
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
            self._compiler = GrammarCompiler(tokenizer, self._vocab_size, end_ids)
        return self._compiler
