"""Structured outputs: what a request constrains its tokens to, and the grammar engine doing it.

``spec`` turns each peer's wire fields (vLLM's ``structured_outputs``, chat's
``response_format``, SGLang's ``json_schema`` / ``regex`` / ``ebnf``, Anthropic's
``output_format``, Responses' ``text.format``) into one ``Constraint``; it imports no grammar
engine. ``grammar`` compiles a constraint with llguidance (off the event loop, cached by
constraint) into a ``CompiledGrammar`` that a request carries in its ``SamplingParams``; the hf
sampler asks it for a ``GrammarState`` per request and masks that row's logits with it.
"""
