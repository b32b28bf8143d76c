"""Recipes: a TOML file that names the calls of one fine-tuning run, checked before anything runs.

    resume_from = "runs/lora/checkpoint"   # optional: continue this checkpoint (then no [method])

    [model]        path ("embedded:smollm2" or a GGUF), storage, device, max_memory_bytes
    [data]         training, validation (CSV files), input, target, context
    [method]       name (lora | rs_lora | lora_fa | tinylora | qlora | full) and that method's arguments
    [profile]      precision, optimizer, nf4_kernel, page_bytes, cuda_graphs, adapter_kernel, layer_kernel,
                   attention_kernel
                   (model.with_training_profile)
    [training]     steps, micro_batch, accumulation, rate, seed, clip_norm
    [checkpoints]  every, directory (default: <output.directory>/checkpoints)
    [output]       directory (a fresh run folder), and names inside it: checkpoint, merged, q4_0,
                   adapter, peft; ollama = true writes a Modelfile beside the q4_0 (else merged) GGUF

Every key is an argument of the API call it names, with the API's default where the recipe leaves
it out. Paths are relative to the recipe file's folder. `check` finds every problem at once without
importing a model or writing anything: it reads the model's GGUF metadata (no weights) and the CSV
files, and runs the API's own pure validators (RunConfig, the adapter registry, the budget and
device checks) one key at a time, so that each problem is reported at its key's line.
"""
import dataclasses
import difflib
import inspect
import os
import re
import tomllib
from pathlib import Path

from . import gen
from .errors import AnerError, ConfigError
from .model import names
from .model.handle import PretrainedModel

STR, INT, NUMBER, BOOL, STRINGS = "a string", "an integer", "a number", "true or false", \
    "a string or a list of strings"
SCHEMA = {
    "": {"resume_from": STR},
    "model": {"path": STR, "storage": STR, "device": STR, "max_memory_bytes": INT},
    "data": {"training": STR, "validation": STR, "input": STR, "target": STR, "context": INT},
    "method": {"name": STR, "targets": STRINGS, "rank": INT, "alpha": NUMBER, "seed": INT,
               "parameters": INT, "sharing": STR},
    "profile": {"precision": STR, "optimizer": STR, "nf4_kernel": STR, "page_bytes": INT,
                "cuda_graphs": BOOL, "adapter_kernel": STR, "layer_kernel": STR, "attention_kernel": STR},
    "training": {"steps": INT, "micro_batch": INT, "accumulation": INT, "rate": NUMBER, "seed": INT,
                 "clip_norm": NUMBER},
    "checkpoints": {"every": INT, "directory": STR},
    "output": {"directory": STR, "checkpoint": STR, "merged": STR, "q4_0": STR, "adapter": STR,
               "peft": STR, "ollama": BOOL},
}
REQUIRED = [("data", "training"), ("data", "validation"), ("training", "steps"), ("output", "directory")]
METHODS = {"lora": "lora", "rs_lora": "rslora", "lora_fa": "lora_fa", "tinylora": "tinylora",  # name -> registry kind
           "qlora": "lora", "full": None}
STORAGES = {"float32": None, "nf4": False, "nf4_double_quant": True}      # storage -> import_nf4 double_quant
EMBEDDED = ("embedded:smollm2",)                                      # aner.embedded.default_model_path()
RESERVED = ("metrics.jsonl", "loss.png", "checkpoints", "Modelfile")     # what a run writes itself
ARTIFACTS = ("checkpoint", "merged", "q4_0", "adapter", "peft")
RESUME_FIXED = {"model": ("path", "storage"), "method": tuple(SCHEMA["method"]),   # what a checkpoint fixes
                "profile": tuple(SCHEMA["profile"]),
                "training": ("micro_batch", "accumulation", "rate", "seed", "clip_norm")}


class RecipeError(ConfigError):
    """A recipe with problems; the message lists every one with its line."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    path: Path
    values: dict            # section -> {key: value}; "" holds the top-level keys
    lines: dict             # (section, key) -> line number, or "--set" for an override

    def get(self, section, key, default=None):
        return self.values.get(section, {}).get(key, default)

    def section(self, name) -> dict:
        return dict(self.values.get(name, {}))

    def resolve(self, value) -> Path:
        """A recipe path: relative to the recipe's folder; `embedded:<name>` is the embedded model."""
        if value in EMBEDDED:
            from .embedded import default_model_path
            return default_model_path()
        return Path(os.path.normpath(self.path.parent / Path(value).expanduser()))

    def output(self, key=None) -> Path:
        out = self.resolve(self.get("output", "directory"))
        return out if key is None else out / self.get("output", key)

    def stop_checkpoint(self) -> Path:
        """Where a run stopped by Ctrl-C publishes its checkpoint: output.checkpoint, else `checkpoint`."""
        return self.output() / self.get("output", "checkpoint", "checkpoint")

    def resume(self) -> bool:
        return "resume_from" in self.values.get("", {})

    def line(self, section, key=None):
        """The line of a key (else of its section), "--set" for an override, or None."""
        return self.lines.get((section, key or ""), self.lines.get((section, "")))

    def where(self, section, key=None) -> str:
        line = self.line(section, key)
        if line == "--set":
            return f"{self.path} (--set {section}.{key})"
        return f"{self.path}:{line}" if line else str(self.path)


def load(path, overrides=()) -> Recipe:
    """Parse a recipe and apply `--set section.key=value` overrides (value in TOML syntax, else text)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise RecipeError(f"recipe {str(path)!r} does not exist or is not a file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from e
    values = {"": {}}
    for key, value in data.items():
        if isinstance(value, dict):
            values[key] = value
        else:
            values[""][key] = value
    lines = key_lines(text)
    for item in overrides:
        name, eq, raw = item.partition("=")
        if not eq or not name.strip():
            raise RecipeError(f"--set {item!r} is not accepted; accepted: --set section.key=value")
        section, _, key = name.strip().rpartition(".")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw                      # plain text: --set output.directory=runs/a
        values.setdefault(section, {})[key] = value
        lines[(section, key)] = "--set"
    return Recipe(path, values, lines)


def key_lines(text: str) -> dict:
    """(section, key) -> line of its first appearance, (section, "") -> its header line.
    tomllib reports no positions, so this is a small scan of `[section]` and `key =` lines."""
    lines, section = {}, ""
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if m := re.match(r"\[\s*([\w.\-\"]+)\s*\]", s):
            section = m.group(1).replace('"', "")
            lines.setdefault((section, ""), n)
        elif m := re.match(r"([\w.\-\"]+)\s*=", s):
            full = (section + "." if section else "") + m.group(1).replace('"', "")
            sec, _, key = full.rpartition(".")
            lines.setdefault((sec, key), n)
            lines.setdefault((sec, ""), n)
    return lines


# ---- checking ----------------------------------------------------------------------------------

class _Problems(list):
    def __init__(self, recipe):
        super().__init__()
        self.recipe = recipe
        self.bad = set()                     # (section, key) with a problem of its own

    def add(self, section, key, message):
        name = f"[{section}] {key}" if section and key else (f"[{section}]" if section else key)
        line = self.recipe.line(section, key)
        order = line if isinstance(line, int) else 1 << 30          # overrides and missing keys last
        self.append((order, f"{self.recipe.where(section, key)}: {name}: {message}"))


def check(recipe: Recipe) -> list[str]:
    """Every problem of `recipe`, each as `file:line: [section] key: message`; [] when it can run."""
    p = _Problems(recipe)
    _check_names_and_types(recipe, p)
    resume = recipe.resume()
    v = {s: {k: x for k, x in recipe.section(s).items() if (s, k) not in p.bad} for s in SCHEMA}
    config, start, method = None, 0, v["method"].get("name")

    if resume:
        for section, keys in RESUME_FIXED.items():
            for key in (k for k in keys if k in recipe.section(section)):
                p.add(section, key, "a resume continues the checkpoint's base, method and run settings; "
                                    "remove it (other settings need a new fine-tuning run)")
        config, start, method, device = _check_checkpoint(recipe, v, p)
        if device is not None and v["model"].get("device", device) != device:
            p.add("model", "device", f"the checkpoint resumes on its recorded device {device!r}; "
                                     f"got {v['model']['device']!r}")
    else:
        for section, key in (("model", "path"), ("method", "name")):
            if recipe.get(section, key) is None:
                p.add(section, key, f"is required (set [{section}] {key} = ...)")
        config = _check_model(recipe, v, p)
        _check_method(recipe, v, p, config)

    _check_model_options(v, p)
    _check_data(recipe, v, p, config)
    _check_training(recipe, v, p, resume)
    if not resume:
        _check_profile(v, p)
    _check_outputs(recipe, v, p, method, start)
    return [text for _, text in sorted(p, key=lambda x: x[0])]      # in line order; stable otherwise


def _check_names_and_types(recipe, p):
    for section, values in recipe.values.items():
        if section not in SCHEMA:
            p.add(section, None, f"unknown section{_suggest(section, [s for s in SCHEMA if s])}")
            p.bad.update((section, k) for k in values)
            continue
        for key, value in values.items():
            if key not in SCHEMA[section]:
                p.add(section, key, f"unknown key{_suggest(key, SCHEMA[section])}")
                p.bad.add((section, key))
            elif not _typed(value, SCHEMA[section][key]):
                p.add(section, key, f"{value!r} is {_kind(value)}; expected {SCHEMA[section][key]}")
                p.bad.add((section, key))
    for section, key in REQUIRED:
        if recipe.get(section, key) is None and (section, key) not in p.bad:
            p.add(section, key, f"is required (set [{section}] {key} = ...)")
            p.bad.add((section, key))


def _typed(value, kind) -> bool:
    if kind == STRINGS:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {STR: str, BOOL: bool}[kind])


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _suggest(word, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(choices)}"


def _each(p, section, given: dict, defaults: dict, validate):
    """Report each problem of a section at its key, though an API validator stops at its first
    error: a key is at fault where it fails with the API's defaults for the other keys and still
    fails beside the given keys that pass so (a value is not refused for a default that another
    given key replaces: cuda_graphs with a decoded NF4 kernel); what fails only in combination is
    the section's."""
    def error(**keys):
        try:
            validate(**(defaults | keys))
        except AnerError as e:
            return e
        return None
    alone = {key: error(**{key: value}) for key, value in given.items()}
    fine = {key: given[key] for key, e in alone.items() if e is None}
    faults = {key: e for key in given if alone[key] is not None and (e := error(**(fine | {key: given[key]})))}
    for key, e in faults.items():
        p.add(section, key, str(e))
    if not faults and (e := error(**given)):
        p.add(section, None, str(e))


def _check_model(recipe, v, p):
    path = v["model"].get("path")
    if path is None:
        return None
    if path.startswith("embedded:") and path not in EMBEDDED:
        p.add("model", "path", f"{path!r} is not an embedded model{_suggest(path, EMBEDDED)}")
        return None
    resolved = recipe.resolve(path)
    if path in EMBEDDED and not resolved.is_file():
        p.add("model", "path", f"the embedded model is not set up at {str(resolved)!r}; run "
                               "`python -m aner.embedded` (or `make model`) first")
        return None
    try:
        return gen._open_floating(resolved)[1]      # GGUF metadata and tensor table; no weights read
    except AnerError as e:
        p.add("model", "path", str(e))
    except OSError as e:
        p.add("model", "path", f"{str(resolved)!r} cannot be read: {e.strerror or e}")


def _check_checkpoint(recipe, v, p):
    """(config, start updates, method, device) of the checkpoint named by resume_from."""
    from .formats.checkpoint import read_manifest
    from .formats.gguf import read_gguf
    from .model.config import LlamaConfig
    if "resume_from" not in v[""]:
        return None, 0, None, None
    path = recipe.resolve(v[""]["resume_from"])
    try:
        manifest = read_manifest(path)           # verifies every checksum
        config = LlamaConfig.from_gguf(read_gguf(path / "metadata.gguf"), tied=manifest["tied_embeddings"])
    except AnerError as e:
        p.add("", "resume_from", str(e))
        return None, 0, None, None
    if manifest["run"] is None:
        p.add("", "resume_from", f"checkpoint {str(path)!r} holds no training run to resume (it was "
                                 "published before any update); start a fine-tuning run instead")
    method = manifest["adapter"]["method"] if manifest["adapter"] else "full"
    method = {"rslora": "rs_lora"}.get(method, method)
    return config, manifest["counters"]["updates"], method, manifest["device"]


def _check_model_options(v, p):
    from .model.handle import check_device
    from .train.memory import check_budget
    m = v["model"]
    if "storage" in m and m["storage"] not in STORAGES:
        p.add("model", "storage", f"{m['storage']!r} is not a storage{_suggest(m['storage'], STORAGES)}")
    for key, validate in (("device", check_device), ("max_memory_bytes", check_budget)):
        if key in m:
            try:
                validate(m[key])
            except AnerError as e:
                p.add("model", key, str(e))


def _check_method(recipe, v, p, config):
    from .adapters import registry
    m = dict(v["method"])
    name = m.pop("name", None)
    if name is None:
        return
    if name not in METHODS:
        p.add("method", "name", f"{name!r} is not a method{_suggest(name, METHODS)}")
        return
    if name == "full":
        for key in m:
            p.add("method", key, "full fine-tuning takes no method arguments; remove it")
        storage = v["model"].get("storage", "float32")
        if STORAGES.get(storage) is not None:     # a packed base
            p.add("method", "name", f"full fine-tuning of an {storage} base is refused: a packed base is frozen; "
                                    "choose an adapter method (lora, rs_lora, lora_fa, tinylora, qlora)")
        return
    defaults = arguments(getattr(PretrainedModel, name))
    for key in [k for k in m if k not in defaults]:
        why = " (TinyLoRA has no alpha: its scale is 1)" if name == "tinylora" and key == "alpha" else ""
        p.add("method", key, f"is not an argument of {name}(){why}; accepted: {', '.join(defaults)}")
        del m[key]
    if config is None:
        return
    shapes = {n: tuple(s) for n, (_, _, s) in names.expected(config).items()}

    def validate(targets, rank, seed, alpha=1.0, **extra):
        registry.config(METHODS[name], targets, rank, alpha, seed, config, shapes, **extra)
    _each(p, "method", m, defaults, validate)


def arguments(fn) -> dict:
    """name -> default of `fn`'s keyword arguments (self and arguments without defaults left out)."""
    return {k: a.default for k, a in inspect.signature(fn).parameters.items()
            if a.default is not inspect.Parameter.empty}


def _check_data(recipe, v, p, config):
    from .data.supervised import read_csv_rows
    d = v["data"]
    for role in ("training", "validation"):
        if role in d:
            try:
                read_csv_rows(recipe.resolve(d[role]), d.get("input", "question"), d.get("target", "answer"))
            except AnerError as e:
                p.add("data", role, str(e))
    if "context" in d and config is not None and not 2 <= d["context"] <= config.context_length:
        p.add("data", "context", f"context={d['context']} is outside the model's accepted range "
                                 f"2..{config.context_length}")


def _check_training(recipe, v, p, resume):
    from .train.loop import RunConfig, check_steps
    t = dict(v["training"])
    if "steps" in t:
        try:
            check_steps(t.pop("steps"))
        except AnerError as e:
            p.add("training", "steps", str(e))
    if not resume:
        _each(p, "training", t, dataclasses.asdict(RunConfig()), RunConfig)


def _check_profile(v, p):
    from .train.profile import Profile
    given = v["profile"]
    if not given:
        return

    def validate(**kw):
        Profile(**kw).check_placement(v["model"].get("device", "cpu"), v["model"].get("storage", "float32"))
    _each(p, "profile", given, dataclasses.asdict(Profile()), validate)


def _check_outputs(recipe, v, p, method, start):
    o, c = v["output"], v["checkpoints"]
    if "directory" in o and recipe.output().exists():
        p.add("output", "directory", f"{str(recipe.output())!r} already exists; a run publishes into a fresh "
                                     "folder and never overwrites: choose a new one")
    seen = set()
    for key in (k for k in ARTIFACTS if k in o):
        name = o[key]
        if not name or "/" in name or "\\" in name or name in (".", "..") or name in RESERVED:
            p.add("output", key, f"{name!r} is not accepted; accepted: a plain name inside output.directory "
                                 f"(no folders), other than {', '.join(RESERVED)}")
        elif name in seen:
            p.add("output", key, f"{name!r} is already the name of another output; each needs its own")
        seen.add(name)
    if method == "full":
        for key in ("adapter", "peft"):
            if key in o:
                p.add("output", key, "a full fine-tune has no adapter to save: every weight changed; "
                                     "publish output.merged instead")
    if "q4_0" in o and "merged" not in o:
        p.add("output", "q4_0", "q4_0 quantizes the merged GGUF: set output.merged too")
    if o.get("ollama") and "merged" not in o and "q4_0" not in o:
        p.add("output", "ollama", "the Modelfile refers to a GGUF: set output.merged or output.q4_0 too")
    if "every" in c and "steps" in v["training"]:
        every, first, last = c["every"], start + 1, start + v["training"]["steps"]
        if every < 1 or last // every * every < first:
            p.add("checkpoints", "every", f"every={every} publishes no checkpoint in this run's updates "
                                          f"{first}..{last}; accepted: 1..{last - start}")
    if c and "every" not in c:
        p.add("checkpoints", "every", "is required when [checkpoints] is present")
    if "directory" in c and not recipe.resolve(c["directory"]).is_dir():
        p.add("checkpoints", "directory", f"{str(recipe.resolve(c['directory']))!r} does not exist or is not a "
                                          "folder; create it first (each run publishes into a fresh child)")


def checked(path, overrides=()) -> Recipe:
    """The recipe at `path`, or RecipeError listing every problem."""
    recipe = load(path, overrides)
    problems = check(recipe)
    if problems:
        raise RecipeError(f"{len(problems)} problem(s) in {path}:\n" + "\n".join(problems))
    return recipe


# ---- running -----------------------------------------------------------------------------------

def run(recipe: Recipe, say=print) -> str:
    """Make the recipe's calls in order, printing each as Python; return 'completed' or 'stopped'.

    A Ctrl-C during training stops at the next update boundary; the stopped model (evaluated like
    a finished one) is published as a checkpoint that resumes exactly — at output.checkpoint, or
    `checkpoint` in the run folder — and no other output is written.
    """
    from . import metrics
    m, d, t = recipe.section("model"), recipe.section("data"), recipe.section("training")
    options = {k: m[k] for k in ("device", "max_memory_bytes") if k in m}
    if recipe.resume():
        path = recipe.resolve(recipe.get("", "resume_from"))
        say(f"model = gen.load_pretrained_checkpoint({_args(str(path), **options)})")
        model = gen.load_pretrained_checkpoint(path, **options)
    elif m.get("storage", "float32") == "float32":
        path = recipe.resolve(m["path"])
        say(f"model = gen.import_model({_args(str(path), **options)})")
        model = gen.import_model(path, **options)
    else:
        path, double_quant = recipe.resolve(m["path"]), STORAGES[m["storage"]]
        say(f"model = gen.import_nf4({_args(str(path), double_quant=double_quant, **options)})")
        model = gen.import_nf4(path, double_quant=double_quant, **options)

    data = {}
    columns = {k: d[k] for k in ("input", "target", "context") if k in d}
    for role in ("training", "validation"):
        path = recipe.resolve(d[role])
        say(f"{role} = gen.supervised_csv(model, {_args(str(path), role=role, **columns)})")
        data[role] = gen.supervised_csv(model, path, role=role, **columns)
        say(f"# {data[role].summary()}")

    method = recipe.section("method")
    name = method.pop("name", "full")
    if not recipe.resume() and name != "full":
        say(f"model = model.{name}({_args(**method)})")
        model = getattr(model, name)(**method)
    if "profile" in recipe.values:
        profile = recipe.section("profile")
        say(f"model = model.with_training_profile({_args(**profile)})")
        model = model.with_training_profile(**profile)
    say(f"# {model.summary()}")

    if recipe.resume():
        say(f"plan = model.resume_plan(training, validation, steps={t['steps']})")
        plan = model.resume_plan(data["training"], data["validation"], steps=t["steps"])
    else:
        say(f"plan = model.fine_tune_plan(training, validation, {_args(**t)})")
        plan = model.fine_tune_plan(data["training"], data["validation"], **t)
    out = recipe.output()
    out.mkdir(parents=True)                   # checked fresh; created only once the plan is valid
    c = recipe.section("checkpoints")
    if c:
        folder = recipe.resolve(c["directory"]) if "directory" in c else out / "checkpoints"
        folder.mkdir(exist_ok="directory" in c)
        say(f"plan = plan.checkpoints({_args(str(folder), every=c['every'])})")
        plan = plan.checkpoints(folder, c["every"])

    say("result = plan.start().wait()   # progress: metrics.jsonl; Ctrl-C stops at the next update")
    result = metrics.follow(plan.start(), out)
    say(f"# {result.summary()}")
    if result.status() == "failed":
        raise result.exception()
    tuned = result.model()
    if result.status() == "stopped":
        say(f"result.model().checkpoint({str(recipe.stop_checkpoint())!r})")
        tuned.checkpoint(recipe.stop_checkpoint())
        return "stopped"
    _publish(recipe, tuned, say)
    return "completed"


def _publish(recipe: Recipe, model, say) -> None:
    """The outputs the recipe names, in a fixed order (a quantized file needs the merged one)."""
    from .formats.ollama import write_modelfile
    o = recipe.section("output")
    if "checkpoint" in o:
        say(f"model.checkpoint({str(recipe.output('checkpoint'))!r})")
        model.checkpoint(recipe.output("checkpoint"))
    if "merged" in o:
        say(f"model.save_model({str(recipe.output('merged'))!r})")
        model.save_model(recipe.output("merged"))
    if "q4_0" in o:
        say(f"gen.quantize_model({_args(str(recipe.output('merged')), str(recipe.output('q4_0')), format='q4_0')})")
        gen.quantize_model(recipe.output("merged"), recipe.output("q4_0"), format="q4_0")
    if "adapter" in o:
        say(f"model.save_adapter({str(recipe.output('adapter'))!r})")
        model.save_adapter(recipe.output("adapter"))
    if "peft" in o:
        say(f"model.save_peft_adapter({str(recipe.output('peft'))!r})")
        model.save_peft_adapter(recipe.output("peft"))
    if o.get("ollama"):
        gguf = recipe.output("q4_0" if "q4_0" in o else "merged")
        say(f"aner.formats.ollama.write_modelfile({str(gguf)!r})")
        write_modelfile(gguf)


def _args(*args, **kwargs) -> str:
    return ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
