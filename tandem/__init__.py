"""tandem: an LLM inference engine that keeps the CPU one step ahead of the GPU."""
from tandem.entrypoints.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
