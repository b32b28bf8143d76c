"""Quantize a GGUF model with llama.cpp's own quantizer, for deployment.

The bytes come from `llama_model_quantize` of the pinned llama.cpp, so the result is exactly what
llama.cpp's `llama-quantize` tool writes for the same type: llama.cpp's choices apply (1-D tensors
such as norms stay F32; a tensor whose rows do not divide into the type's blocks falls back to a
compatible type). Requantizing an already quantized source is refused by llama.cpp and reported as
a FormatError. The output is staged beside `dst` and published whole.
"""
import ctypes
import os
from pathlib import Path

from ..data.tokenizer import clear_engine_log, engine, engine_log, require_gguf
from ..errors import ConfigError, FormatError
from .publish import refuse_existing, staged_file

# format name -> llama.cpp file type (enum llama_ftype; values fixed by llama.h)
FORMATS = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",   # 2: 4-bit blocks of 32, one F16 scale
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",   # 3: 4-bit blocks of 32, F16 scale and minimum
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",   # 8
    "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",   # 9
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",   # 7: 8-bit blocks of 32, one F16 scale
    "f16": "LLAMA_FTYPE_MOSTLY_F16",     # 1
}


def quantize_gguf(src, dst, format: str = "q4_0") -> Path:
    """Write `src` quantized to `format` at `dst` (which must not exist); returns `dst`."""
    if format not in FORMATS:
        raise ConfigError(f"quantization format {format!r} is not accepted; accepted: "
                          f"{', '.join(FORMATS)}")
    src = require_gguf(src, "model to quantize")
    dst = refuse_existing(dst)
    llama = engine()
    params = llama.llama_model_quantize_default_params()
    params.ftype = getattr(llama, FORMATS[format])
    with staged_file(dst) as tmp:
        clear_engine_log()
        rc = llama.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0:
            raise FormatError(f"llama.cpp could not quantize {str(src)!r} to {format} (return code "
                              f"{rc}); {engine_log()}")
    return dst
