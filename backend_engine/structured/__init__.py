"""Constrained decoding (structured outputs) with xgrammar: grammars compiled off the step loop
and cached, one matcher per sequence, and the batch's token bitmask filled while the forward
pass runs, then applied by the sampler. The engine drives them through
structured_output_manager.py."""

from backend_engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
