"""aner: fine-tune Llama-family GGUF models and deploy the results back to llama.cpp."""
from . import gen, llm
from .errors import AnerError

__all__ = ["gen", "llm", "AnerError"]
__version__ = "0.1.0"
