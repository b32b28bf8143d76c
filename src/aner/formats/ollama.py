"""Ollama Modelfiles: serve a GGUF we wrote with `ollama create NAME -f Modelfile`.

Training renders conversations with llama.cpp's built-in chat convention (the model's Jinja
template is only inspected, never executed), so the Modelfile's TEMPLATE must render exactly what
that convention renders, not what the model's Jinja would (SmolLM2's adds a default system prompt;
llama.cpp's ChatML does not). Only ChatML is written here, and only after a probe conversation
rendered by llama.cpp matches `render_chatml`, the Python twin of CHATML_TEMPLATE.
"""
from pathlib import Path

from ..errors import ConfigError
from .publish import staged_file

FORMAT_LINE = "# aner.modelfile/1"
# Ollama's Go template: .Messages holds the system, user and assistant turns in order.
CHATML_TEMPLATE = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
CHATML_STOPS = ("<|im_start|>", "<|im_end|>")
PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
         {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]


def render_chatml(messages) -> str:
    """What CHATML_TEMPLATE renders for `messages`, with the assistant header appended."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


def modelfile(gguf) -> str:
    """The Modelfile text for the GGUF at `gguf` (FROM a path relative to the Modelfile's folder)."""
    from ..data.tokenizer import Tokenizer
    gguf = Path(gguf)
    with Tokenizer.from_gguf(gguf) as tok:
        rendered = tok.apply_template(PROBE, add_assistant=True)
    if rendered != render_chatml(PROBE):
        raise ConfigError(f"{str(gguf)!r} uses a chat convention other than ChatML (a probe renders as "
                          f"{rendered[:80]!r}); Modelfiles are written for ChatML models only")
    stops = "".join(f'PARAMETER stop "{s}"\n' for s in CHATML_STOPS)
    return f'{FORMAT_LINE}\nFROM ./{gguf.name}\nTEMPLATE """{CHATML_TEMPLATE}"""\n{stops}'


def write_modelfile(gguf) -> str:
    """Write `Modelfile` beside the GGUF at `gguf` (refused if one exists); returns its path."""
    text = modelfile(gguf)
    dst = Path(gguf).parent / "Modelfile"
    with staged_file(dst) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return str(dst)
