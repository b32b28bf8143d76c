"""aner: fine-tune Llama-family GGUF models and deploy the results back to llama.cpp.

`from aner import gen, llm` loads each module on first use, so that commands that never train
(`aner --help`, `aner chat`) do not pay for importing PyTorch.
"""
import importlib

from .errors import AnerError

__all__ = ["gen", "llm", "AnerError"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("gen", "llm"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'aner' has no attribute {name!r}")
