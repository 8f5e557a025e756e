"""Structured output: grammar-constrained sampling whose CPU mask work overlaps the forward.

A step's allowed-token mask needs the previous step's token, which the host learns only
after it queued the next forward. So a step that samples for a constrained request is
queued in two parts (docs/async-model.md, "Token masks"): the forward, then, after the host
processed the previous step and advanced each request's matcher, the masked sampling,
which waits on the GPU for the mask's host-to-device copy. The FutureMap is untouched.

xgrammar is imported, and its tokenizer info built, by the grammar pool as the engine starts
(in the background: neither start-up nor the engine loop waits for it).
"""
from tandem.grammar.manager import GrammarManager, MaskFill
from tandem.grammar.mask import GrammarMask, MaskProducer

__all__ = ["GrammarManager", "GrammarMask", "MaskFill", "MaskProducer"]
