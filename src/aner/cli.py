"""The `aner` command: recipes, checking, chat, generation, inspection and conversion.

    aner check RECIPE.toml...            validate without importing a model or writing anything
    aner run RECIPE.toml                 perform the recipe's calls (progress, metrics.jsonl, loss.png)
    aner chat MODEL.gguf [--adapter DIR] interactive chat through llama.cpp, streamed
    aner generate MODEL.gguf "prompt"    one completion (--chat: as a user message)
    aner inspect PATH... [--json]        GGUF, checkpoint, adapter, adapter package, PEFT adapter, recipe
    aner convert SRC DST [--dtype f16]   dequantize any GGUF to a floating one
    aner quantize SRC DST [--format q4_0]
    aner export CHECKPOINT --merged OUT.gguf | --q4 OUT.gguf | --adapter DIR | --peft DIR [--ollama]

`run` and `check` take `--set section.key=value` overrides (value in TOML syntax). Every command
calls the Python API (`aner.gen`, `aner.llm`, handles and jobs); none reimplements it.
Exit status: 0 success, 2 a refused recipe or input (the error's message, no traceback),
130 a run stopped by Ctrl-C (its checkpoint published), 1 an internal error (with traceback).
"""
import argparse
import json
import math
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from .errors import AnerError, ArtifactError, FormatError

STOPPED = 130


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command is None:
        parser().print_help(sys.stderr)
        return 2
    try:
        return args.command(args)
    except AnerError as e:
        print(f"aner: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\naner: interrupted", file=sys.stderr)
        return STOPPED
    except BrokenPipeError:                   # `aner inspect ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aner", description="Fine-tune Llama GGUF models and deploy them to llama.cpp.")
    p.set_defaults(command=None)
    sub = p.add_subparsers(metavar="COMMAND")

    def command(name, fn, help):
        c = sub.add_parser(name, help=help, description=help)
        c.set_defaults(command=fn)
        return c

    overrides = dict(action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a recipe value (TOML syntax; repeatable)")
    c = command("check", check, "validate recipes without importing a model or writing anything")
    c.add_argument("recipes", nargs="+", metavar="RECIPE")
    c.add_argument("--set", dest="overrides", **overrides)
    c = command("run", run, "perform a recipe's calls: import, data, method, training, outputs")
    c.add_argument("recipe")
    c.add_argument("--set", dest="overrides", **overrides)

    def deployment(c):
        c.add_argument("model", help="a GGUF model, or an adapter package folder (its base.gguf and adapter)")
        c.add_argument("--adapter", help="an adapter folder (adapter.json) or adapter package")
        c.add_argument("--context", type=int, default=2048, help="context window in tokens (default 2048)")
        c.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--device", default="cpu")

    c = command("chat", chat, "chat with a model through llama.cpp, streamed; /exit or Ctrl-D ends")
    deployment(c)
    c.add_argument("--max-tokens", type=int, default=256, help="per reply (default 256)")
    c.add_argument("--system", help="a system message opening the conversation")
    c = command("generate", generate, "complete one prompt through llama.cpp, streamed")
    deployment(c)
    c.add_argument("prompt")
    c.add_argument("--max-tokens", type=int, default=128, help="default 128")
    c.add_argument("--chat", action="store_true", help="send the prompt as a user message in the chat template")

    c = command("inspect", inspect, "explain a GGUF, checkpoint, adapter, adapter package, PEFT adapter or recipe")
    c.add_argument("paths", nargs="+", metavar="PATH")
    c.add_argument("--json", action="store_true", help="one JSON object per path, one per line")

    c = command("convert", convert, "dequantize a GGUF into a floating F16/F32 GGUF (gen.dequantize_model)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    c = command("quantize", quantize, "quantize a floating GGUF with llama.cpp (gen.quantize_model)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--format", default="q4_0", help="q4_0 (default), q4_1, q5_0, q5_1, q8_0, f16")

    c = command("export", export, "publish deployment artifacts from a checkpoint")
    c.add_argument("checkpoint")
    c.add_argument("--merged", metavar="OUT.gguf", help="merged F32 GGUF (model.save_model)")
    c.add_argument("--q4", metavar="OUT.gguf", help="merged and quantized to q4_0 (gen.quantize_model)")
    c.add_argument("--adapter", metavar="DIR", help="llama.cpp LoRA adapter folder (model.save_adapter)")
    c.add_argument("--peft", metavar="DIR", help="PEFT LoRA adapter folder (model.save_peft_adapter)")
    c.add_argument("--ollama", action="store_true",
                   help="also write an Ollama Modelfile beside the q4 (else merged) GGUF")
    c.add_argument("--device", default="cpu")
    c.add_argument("--max-memory-bytes", type=int, default=4 << 30)
    return p


# ---- recipes -----------------------------------------------------------------------------------

def check(args) -> int:
    from . import recipe
    status = 0
    for path in args.recipes:
        try:
            r = recipe.checked(path, args.overrides)
        except AnerError as e:
            print(f"aner: error: {e}", file=sys.stderr)
            status = 2
            continue
        what = "resume" if r.resume() else r.get("method", "name")
        print(f"{path}: OK ({what}, {r.get('training', 'steps')} updates, into {r.output()})")
    return status


def run(args) -> int:
    from . import recipe
    r = recipe.checked(args.recipe, args.overrides)
    status = recipe.run(r, say=lambda line: print(line, flush=True))
    if status == "stopped":
        path = r.stop_checkpoint()
        print(f"aner: stopped by Ctrl-C; checkpoint {str(path)!r} resumes exactly: set "
              f"resume_from = {str(path)!r} in a recipe", file=sys.stderr)
        return STOPPED
    print(f"aner: done; metrics.jsonl and loss.png in {str(r.output())!r}")
    return 0


# ---- deployment through llama.cpp --------------------------------------------------------------

def _open(args):
    """(base, model): the llama.cpp model, and the same with the adapter applied (or base again)."""
    from . import llm
    from .formats.export import AdapterManifest
    model, adapter = Path(args.model), args.adapter and Path(args.adapter)
    if model.is_dir() and (model / "deployment.json").is_file():    # an adapter package
        if adapter:
            raise ArtifactError(f"{str(model)!r} is an adapter package with its own adapter; drop --adapter")
        model, adapter = model / "base.gguf", model / "adapter"
    if adapter and (adapter / "deployment.json").is_file():
        adapter = adapter / "adapter"
    if adapter and not (adapter / "adapter.json").is_file():
        raise ArtifactError(f"{str(adapter)!r} is not an adapter folder (no adapter.json)")
    base = llm.load(model, context=args.context, device=args.device)
    if not adapter:
        return base, base
    try:
        return base, base.with_adapter(AdapterManifest.load(adapter))
    except BaseException:
        base.close()
        raise


def _echo(pieces) -> str:
    """Print text pieces as they come; return their concatenation."""
    text = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    return "".join(text)


def chat(args) -> int:
    base, model = _open(args)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    print("aner chat: /exit or Ctrl-D ends, /reset starts a new conversation", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                messages = list(opening)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                reply = _echo(model.stream_chat(messages, max_tokens=args.max_tokens,
                                                temperature=args.temperature, seed=args.seed))
            except (AnerError, KeyboardInterrupt) as e:     # this turn fails; the conversation goes on
                messages.pop()
                print(f"\naner: {e or 'reply interrupted'}", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": reply})
    finally:
        model.close()
        base.close()


def generate(args) -> int:
    base, model = _open(args)
    try:
        kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        _echo(model.stream_chat([{"role": "user", "content": args.prompt}], **kw) if args.chat
              else model.stream(args.prompt, **kw))
    finally:
        model.close()
        base.close()
    return 0


# ---- files -------------------------------------------------------------------------------------

def convert(args) -> int:
    from . import gen
    print(gen.dequantize_model(args.src, args.dst, dtype=args.dtype))
    return 0


def quantize(args) -> int:
    from . import gen
    print(gen.quantize_model(args.src, args.dst, format=args.format))
    return 0


def export(args) -> int:
    from . import gen
    from .formats.ollama import write_modelfile
    from .formats.publish import refuse_existing
    outputs = [p for p in (args.merged, args.q4, args.adapter, args.peft) if p]
    if not outputs:
        raise ArtifactError("nothing to export: give --merged, --q4, --adapter and/or --peft")
    if args.ollama and not (args.merged or args.q4):
        raise ArtifactError("--ollama writes a Modelfile beside a GGUF: give --merged or --q4 too")
    for p in outputs + ([str(Path(args.q4 or args.merged).parent / "Modelfile")] if args.ollama else []):
        refuse_existing(p)                    # before any work: nothing is written unless all can be
    model = gen.load_pretrained_checkpoint(args.checkpoint, device=args.device,
                                           max_memory_bytes=args.max_memory_bytes)
    if args.merged:
        print(model.save_model(args.merged))
    if args.q4:
        if args.merged:
            print(gen.quantize_model(args.merged, args.q4, format="q4_0"))
        else:   # the merged F32 file is a temporary beside the q4_0 file
            with tempfile.TemporaryDirectory(dir=Path(args.q4).parent, prefix=".aner-export.") as tmp:
                merged = model.save_model(Path(tmp) / "merged-f32.gguf")
                print(gen.quantize_model(merged, args.q4, format="q4_0"))
    if args.adapter:
        print(model.save_adapter(args.adapter).path)
    if args.peft:
        print(model.save_peft_adapter(args.peft))
    if args.ollama:
        print(write_modelfile(args.q4 or args.merged))
    return 0


# ---- inspect -----------------------------------------------------------------------------------

def inspect(args) -> int:
    status = 0
    for path in args.paths:
        info = describe(Path(path))
        if info.get("problems"):
            status = 2
        if args.json:
            print(json.dumps(info))
        else:
            _print(info)
    return status


def describe(path: Path) -> dict:
    """What the file or folder at `path` is and holds, verified where it carries checksums."""
    if path.suffix == ".toml" and path.is_file():
        return _recipe(path)
    if path.is_file():
        return _gguf(path)
    for marker, fn in (("manifest.json", _checkpoint), ("deployment.json", _package),
                       ("adapter.json", _adapter), ("adapter_config.json", _peft)):
        if (path / marker).is_file():
            return fn(path)
    raise ArtifactError(f"{str(path)!r} is not a GGUF file, checkpoint, adapter folder, adapter package, "
                        "PEFT adapter or recipe (.toml)")


def _gguf(path: Path) -> dict:
    import dataclasses
    from .data.tokenizer import identity, require_gguf
    from .formats.gguf import read_gguf
    from .model import names
    from .model.config import LlamaConfig
    from .model.handle import CanonicalHash
    g = read_gguf(require_gguf(path))
    tensors = list(g.tensors.values())
    info = {"kind": "gguf", "path": str(path), "architecture": g.get("general.architecture"),
            "name": g.get("general.name"), "type": g.get("general.type", "model"),
            "file_type": g.get("general.file_type"), "tensors": len(tensors),
            "tensor_types": dict(Counter(t.type.name for t in tensors)),
            "parameters": sum(math.prod(t.shape) for t in tensors), "metadata_keys": len(g.fields),
            "sha256": g.sha256()}
    if "tokenizer.ggml.tokens" in g.fields:
        info["tokenizer_sha256"] = identity(g.fields)
        template = g.get("tokenizer.chat_template")
        info["chat_template"] = None if template is None else f"{len(template)} characters, starting {template[:40]!r}"
    if info["type"] == "adapter":
        info["lora_alpha"] = g.get("adapter.lora.alpha")
    else:
        try:
            config = LlamaConfig.from_gguf(g)
            info["config"] = dataclasses.asdict(config)
            names.check_tensors(config, {n: t.shape for n, t in g.tensors.items()})
        except AnerError as e:
            info.setdefault("config", f"not a supported Llama: {e}")
        else:
            if all(t.is_float() for t in tensors):   # over the FP32 values, as gen.import_model hashes them
                h = CanonicalHash(config)
                for name in names.expected(config):
                    h.update(name, g.tensors[name].float32())
                info["canonical_sha256"] = h.hexdigest()
            else:
                info["canonical_sha256"] = "none: quantized tensors (dequantize with `aner convert` first)"
    info["provenance"] = {k: f.value for k, f in g.fields.items() if k.startswith("aner.")}
    return info


def _checkpoint(path: Path) -> dict:
    from .formats.checkpoint import read_manifest
    m = read_manifest(path)                   # verifies the manifest's digest and every file's SHA-256
    sizes = {name: (path / name).stat().st_size for name in m["files"]}
    losses = m["losses"]
    return {"kind": "checkpoint", "path": str(path), "format": f"{m['format']}/{m['version']}",
            "method": m["adapter"]["method"] if m["adapter"] else "full", "adapter": m["adapter"],
            "storage": m["storage"], "profile": m.get("profile"), "device": m["device"], "backend": m["backend"],
            "run": m["run"], "counters": m["counters"], "data": m["data"], "validation_loss": m["validation_loss"],
            "losses": {"updates": len(losses), "first": losses[0] if losses else None,
                       "last": losses[-1] if losses else None},
            "source": m["source"], "lineage": m["lineage"],
            "memory": {"budget_bytes": m["budget_bytes"], "files_bytes": sum(sizes.values()), "files": sizes},
            "integrity": f"verified: the manifest's own SHA-256 and {len(sizes)} files' SHA-256"}


def _verified(path: Path, files: dict) -> str:
    from .formats.publish import sha256_file
    for name, digest in files.items():
        if not (path / name).is_file():
            raise ArtifactError(f"{str(path / name)!r}, listed in {str(path)!r}'s manifest, is missing")
        if sha256_file(path / name) != digest:
            raise ArtifactError(f"{str(path / name)!r} does not match its SHA-256: it was changed or corrupted")
    return f"verified: {len(files)} files' SHA-256"


def _read_json(path: Path, format: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != format:
        raise FormatError(f"{str(path)!r} is not an {format} file (format "
                          f"{data.get('format') if isinstance(data, dict) else None!r})")
    return data


def _adapter(path: Path) -> dict:
    from .formats.export import ADAPTER_FORMAT
    a = _read_json(path / "adapter.json", ADAPTER_FORMAT)
    integrity = _verified(path, a["files"])
    training = json.loads((path / "training.json").read_text()) if "training.json" in a["files"] else None
    return {"kind": "adapter", "path": str(path), "format": f"{a['format']}/{a['version']}",
            "method": a["method"], "rank": a["rank"], "alpha": a["alpha"], "scale": a["scale"],
            "targets": len(a["targets"]), "target_kinds": sorted({t.split(".", 2)[-1] for t in a["targets"]}),
            "base": a["base"], "training": training, "integrity": integrity}


def _package(path: Path) -> dict:
    from .formats.export import DEPLOYMENT_FORMAT
    d = _read_json(path / "deployment.json", DEPLOYMENT_FORMAT)
    integrity = _verified(path, d["files"])
    return {"kind": "adapter package", "path": str(path), "format": f"{d['format']}/{d['version']}",
            "storage": d["storage"], "method": d["method"], "source": d["source"], "base": d["base"],
            "adapter": _adapter(path / "adapter"), "integrity": integrity}


def _peft(path: Path) -> dict:
    from safetensors import safe_open
    config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        metadata, tensors = f.metadata() or {}, len(list(f.keys()))
    return {"kind": "peft adapter", "path": str(path),
            "config": {k: config.get(k) for k in ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules")},
            "tensors": tensors, "provenance": {k: v for k, v in metadata.items() if k.startswith("aner.")}}


def _recipe(path: Path) -> dict:
    from . import recipe
    r = recipe.load(path)
    values = {(s or "top level"): v for s, v in r.values.items() if v}
    return {"kind": "recipe", "path": str(path), "resume": r.resume(), "values": values,
            "problems": recipe.check(r)}


def _print(info: dict, indent: int = 0) -> None:
    pad = " " * indent
    for key, value in info.items():
        if isinstance(value, dict) and value:
            print(f"{pad}{key}:")
            _print(value, indent + 2)
        elif isinstance(value, list) and key == "problems":
            print(f"{pad}{key}: {len(value)}" + "".join(f"\n{pad}  {p}" for p in value))
        elif isinstance(value, list) and len(value) > 6:
            print(f"{pad}{key}: [{len(value)} entries] {', '.join(map(str, value[:3]))}, ...")
        else:
            print(f"{pad}{key}: {value}")
    if indent == 0:
        print()


if __name__ == "__main__":
    sys.exit(main())
