"""Prompt tokenizers: backends that reproduce `hf_tokenizer.encode` exactly, faster.

select_prompt_tokenizer picks one by probing it against hf; VerifiedTokenizer keeps checking a
sample of live prompts in the background and falls back to hf on the first disagreement.
"""
from deepinfer.serve.tokenizer.base import PromptTokenizer, UnsupportedTokenizer
from deepinfer.serve.tokenizer.hf import HFTokenizer
from deepinfer.serve.tokenizer.select import ProbeResult, build_probes, select_prompt_tokenizer
from deepinfer.serve.tokenizer.verify import Mismatch, VerifiedTokenizer

__all__ = [
    "HFTokenizer",
    "Mismatch",
    "ProbeResult",
    "PromptTokenizer",
    "UnsupportedTokenizer",
    "VerifiedTokenizer",
    "build_probes",
    "select_prompt_tokenizer",
]
