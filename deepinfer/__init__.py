"""DeepInfer: a hardware-abstracted LLM serving engine."""
from deepinfer.core.plugins import hookimpl
from deepinfer.core.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(name)
