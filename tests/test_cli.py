"""The `aner` command as a user runs it.

The example recipes are checked and one is run end to end on SmolLM2 (2 updates, context 64);
everything else runs on the tiny random Llama. `aner chat` is driven through a pseudo-terminal.
What needs the process itself (the entry point, exit statuses, SIGINT, a terminal) runs as a
subprocess; the other commands call `aner.cli.main` in this process, since every subprocess pays
~3 s of `import torch` on the 2-core machines.
"""
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from aner import gen, llm
from aner.cli import main
from aner.formats.export import AdapterManifest
from aner.formats.ollama import CHATML_TEMPLATE
from conftest import EXAMPLES
from fixtures import assert_same_state

ANER = Path(sys.executable).with_name("aner")
EXAMPLE_RECIPES = 8                      # lora, rslora, lora_fa, tinylora, qlora, qlora_gpu, full, resume
GPU_RECIPES = 0 if torch.cuda.is_available() else 1    # qlora_gpu.toml is refused without a CUDA device
TINY_RUN = dict(micro_batch=2, accumulation=1, rate=1e-3, seed=3)
PNG = b"\x89PNG\r\n\x1a\n"


def aner(*args, cwd=None, timeout=300):
    """The installed `aner` command in a subprocess."""
    return subprocess.run([str(ANER), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli(capsys):
    """`aner` in this process: cli(*args) -> CompletedProcess-like (returncode, stdout, stderr)."""
    def call(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return call


def line_of(text: str, start: str) -> int:
    """1-based line of the first line of `text` that starts with `start`."""
    return next(i for i, s in enumerate(text.splitlines(), 1) if s.strip().startswith(start))


def tiny_recipe(folder: Path, model, name="recipe.toml", method='name = "lora"\nrank = 2\nseed = 4',
                steps=3, output='directory = "run"\ncheckpoint = "checkpoint"', extra="") -> Path:
    """A recipe for the tiny model and the example data; TINY_RUN's training settings."""
    run = "\n".join(f"{k} = {v}" for k, v in TINY_RUN.items())
    text = (f'[model]\npath = "{model}"\n\n[data]\ntraining = "{EXAMPLES}/data/training.csv"\n'
            f'validation = "{EXAMPLES}/data/validation.csv"\ncontext = 64\n\n[method]\n{method}\n\n'
            f"[training]\nsteps = {steps}\n{run}\n\n[output]\n{output}\n{extra}")
    (folder / name).write_text(text)
    return folder / name


def metrics(folder: Path):
    lines = [json.loads(s) for s in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "update" in x], lines[-1]




def read_until(fd, pattern: bytes, timeout=120) -> bytes:
    out = read_pty(fd, lambda buf: pattern in buf, timeout)
    assert pattern in out, f"no {pattern!r} before the terminal closed; got {out[-500:]!r}"
    return out


def read_pty(fd, done, timeout=120) -> bytes:
    """A pseudo-terminal's output until done(output) holds or every writer closed it."""
    buf, deadline = b"", time.monotonic() + timeout
    while not done(buf):
        assert time.monotonic() < deadline, f"timed out after {timeout} s; got {buf[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], 0.05)
        try:
            chunk = os.read(fd, 65536) if ready else b""
        except OSError:                      # EIO: the other side closed
            break
        if ready and not chunk:
            break
        buf += chunk
    return buf


# ---- the example recipes, and one of them end to end on SmolLM2 --------------------------------

@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2):
    """A copy of examples/ in which lora.toml ran (2 updates, context 64); its check reports first."""
    root = tmp_path_factory.mktemp("examples")
    for part in ("recipes", "data"):
        shutil.copytree(EXAMPLES / part, root / "examples" / part)
    recipes = root / "examples" / "recipes"
    found = sorted(recipes.glob("*.toml"))
    before = aner("check", *found)
    ran = aner("run", recipes / "lora.toml", "--set", "training.steps=2", "--set", "training.accumulation=1",
               "--set", "data.context=64", timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return dict(recipes=recipes, found=found, before=before, ran=ran, out=root / "out" / "lora", model=smollm2)


def test_every_example_recipe_checks(smol, cli):
    assert len(smol["found"]) == EXAMPLE_RECIPES
    before = smol["before"]
    oks = [s for s in before.stdout.splitlines() if s.endswith(")") and ": OK (" in s]
    assert len(oks) == EXAMPLE_RECIPES - 1 - GPU_RECIPES, before.stdout + before.stderr
    if GPU_RECIPES:     # one problem, at its device: its profile's GPU kernels fit together, given a GPU
        gpu = smol["recipes"] / "qlora_gpu.toml"
        refused = [s for s in before.stderr.splitlines() if s.startswith(f"{gpu}:")]
        assert refused == [f"{gpu}:{line_of(gpu.read_text(), 'device')}: [model] device: device='cuda:0' needs "
                           "CUDA, but this PyTorch build or machine has no CUDA device; there is no CPU fallback: "
                           "use device='cpu' explicitly"], before.stderr
    # resume.toml continues lora.toml's checkpoint, which does not exist until lora.toml ran
    resume = smol["recipes"] / "resume.toml"
    line = line_of(resume.read_text(), "resume_from")
    assert before.returncode == 2 and "1 problem(s) in" in before.stderr and "Traceback" not in before.stderr
    assert f"resume.toml:{line}: resume_from: checkpoint" in before.stderr and "does not exist" in before.stderr
    after = cli("check", *smol["found"])
    assert after.stdout.count(": OK (") == EXAMPLE_RECIPES - 1 - GPU_RECIPES
    assert "resume.toml: OK (resume, 10 updates" in after.stdout
    lora = smol["recipes"] / "lora.toml"       # now refused: its run folder exists
    assert f"lora.toml:{line_of(lora.read_text(), 'directory')}: [output] directory:" in after.stderr
    assert "already exists" in after.stderr and after.returncode == 2


def test_example_run_on_smollm2(smol):
    out, ran = smol["out"], smol["ran"]
    # the calls, in the recipe's order, as Python
    calls = [s.split("(")[0] for s in ran.stdout.splitlines() if not s.startswith(("#", "aner:"))]
    assert calls == ["model = gen.import_model", "training = gen.supervised_csv", "validation = gen.supervised_csv",
                     "model = model.lora", "plan = model.fine_tune_plan", "result = plan.start", "model.checkpoint",
                     "model.save_model", "gen.quantize_model", "model.save_adapter", "model.save_peft_adapter",
                     "aner.formats.ollama.write_modelfile"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["checkpoint", "merged-f32.gguf", "merged-q4_0.gguf", "adapter", "peft-adapter", "Modelfile",
         "metrics.jsonl", "loss.png"])
    updates, final = metrics(out)
    assert [u["update"] for u in updates] == [1, 2] and all(u["loss"] > 0 and u["scored_tokens"] > 0 for u in updates)
    assert all(u["tokens_per_s"] > 0 and u["elapsed_s"] > 0 for u in updates)
    assert final["status"] == "completed" and final["updates"] == 2
    assert (out / "loss.png").read_bytes()[:8] == PNG
    checkpoint = gen.load_pretrained_checkpoint(out / "checkpoint")
    assert (checkpoint.updates(), checkpoint.method()) == (2, "lora")
    assert checkpoint.validation_loss() == final["validation_loss"]
    modelfile = (out / "Modelfile").read_text()
    assert "FROM ./merged-q4_0.gguf\n" in modelfile and CHATML_TEMPLATE in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile


def test_inspect_every_artifact_of_the_run(smol, cli):
    out = smol["out"]
    done = cli("inspect", "--json", out / "checkpoint", out / "merged-f32.gguf", out / "merged-q4_0.gguf",
                out / "adapter", out / "peft-adapter", smol["recipes"] / "lora.toml")
    infos = [json.loads(s) for s in done.stdout.splitlines()]
    assert [i["kind"] for i in infos] == ["checkpoint", "gguf", "gguf", "adapter", "peft adapter", "recipe"]
    ck, merged, q4, adapter, peft, recipe = infos
    assert ck["integrity"].startswith("verified") and ck["method"] == "lora" and ck["counters"]["updates"] == 2
    assert ck["storage"] == "float32" and ck["profile"]["precision"] == "float32" and len(ck["lineage"]) == 1
    assert ck["run"] == {"micro_batch": 1, "accumulation": 1, "rate": 0.001, "seed": 71, "clip_norm": 1.0}
    assert ck["memory"]["files_bytes"] == sum(ck["memory"]["files"].values()) > 134_515_008 * 4
    assert (merged["tensors"], merged["parameters"], merged["tensor_types"]) == (272, 134_515_008, {"F32": 272})
    assert merged["config"]["n_layer"] == 30 and merged["provenance"]["aner.method"] == "lora"
    assert merged["provenance"]["aner.updates"] == 2 and len(merged["canonical_sha256"]) == 64
    assert merged["provenance"]["aner.base.source_sha256"] == ck["source"]["sha256"] == adapter["base"]["sha256"]
    assert "Q4_0" in q4["tensor_types"] and q4["canonical_sha256"].startswith("none")
    assert (adapter["method"], adapter["rank"], adapter["targets"]) == ("lora", 16, 30 * 7)
    assert adapter["integrity"].startswith("verified") and adapter["training"]["updates"] == 2
    assert (peft["config"]["r"], peft["tensors"]) == (16, 2 * 30 * 7)
    assert recipe["problems"] and "already exists" in recipe["problems"][0]
    assert done.returncode == 2                  # the recipe's problem; every artifact was explained


# ---- chat and generation through llama.cpp -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny):
    """A 1-update LoRA run of the tiny model with a checkpoint and an adapter."""
    folder = tmp_path_factory.mktemp("tiny-run")
    recipe = tiny_recipe(folder, tiny, steps=1, output='directory = "run"\ncheckpoint = "c"\nadapter = "a"')
    assert main(["run", str(recipe)]) == 0
    return folder / "run"


def test_chat_through_a_pseudo_terminal(tiny, tiny_run):
    """The tiny model: llama.cpp's generation collapses under CPU contention on the shared 2-core
    machines (SmolLM2 + a 210-target adapter: 0.3 s for 8 tokens alone, 73 s beside a busy process)."""
    adapter = tiny_run / "a"
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(ANER), "chat", tiny, "--adapter", adapter, "--max-tokens", "8", "--context", "256"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    questions = ["What is the capital of Tolvara?", "And its currency?"]
    try:
        read_until(master, b"> ")
        replies = []
        for q in questions:
            os.write(master, q.encode() + b"\n")
            text = read_until(master, b"\r\n> ").decode().replace("\r\n", "\n")
            echo, reply = text.split("\n", 1)
            assert echo.endswith(q)
            replies.append(reply.rsplit("\n> ", 1)[0])
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    # the same conversation in-process: the command kept it and printed exactly chat()'s text
    with llm.load(tiny, context=256) as base:
        tuned = base.with_adapter(AdapterManifest.load(adapter))
        first = [{"role": "user", "content": questions[0]}]
        assert tuned.chat(first, max_tokens=8).text() == replies[0] != ""
        second = first + [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": questions[1]}]
        assert tuned.chat(second, max_tokens=8).text() == replies[1] != ""
        probe = base.tokenizer.tokenize(questions[0])
        assert not (base.logits(probe) == tuned.logits(probe)).all()     # the adapter is applied
        tuned.close()


# ---- checking: every problem at once, with its line --------------------------------------------

def test_bad_recipe_reports_every_problem_with_its_line(tmp_path, tiny, cli):
    (tmp_path / "taken").mkdir()
    recipe = tiny_recipe(tmp_path, tiny, method='name = "tinylora"\nalpha = 4.0\nrank = 300',
                         output='directory = "taken"\nadapter = "adapter"\nq4_0 = "q.gguf"',
                         extra='\n[checkpoints]\nevery = 9\n\n[profile]\nprecision = "float16"\n')
    text = recipe.read_text().replace("rate = 0.001", "rate = 2.0").replace("accumulation = 1", "acumulation = 1")
    text = text.replace("micro_batch = 2", 'micro_batch = "two"').replace("context = 64", "context = 9999")
    text = text.replace("[data]", "[dta]\nx = 1\n\n[data]")
    recipe.write_text(text)
    expected = [
        ("dta", "[dta]: unknown section; did you mean 'data'?"),
        ("context", "[data] context: context=9999 is outside the model's accepted range 2..256"),
        ("alpha", "[method] alpha: is not an argument of tinylora() (TinyLoRA has no alpha: its scale is 1)"),
        ("rank", "[method] rank: rank=300 is outside the accepted range 1..256"),
        ("micro_batch", "[training] micro_batch: 'two' is a string; expected an integer"),
        ("acumulation", "[training] acumulation: unknown key; did you mean 'accumulation'?"),
        ("rate", "[training] rate: rate=2.0 is outside the accepted range (0, 1]"),
        ("directory", "[output] directory:"), ("q4_0", "[output] q4_0: q4_0 quantizes the merged GGUF"),
        ("every", "[checkpoints] every: every=9 publishes no checkpoint in this run's updates 1..3"),
        ("precision", "[profile] precision: precision='float16' needs a CUDA device"),
    ]
    lines = {key: line_of(text, "[dta]" if key == "dta" else key) for key, _ in expected}
    before = sorted(p.name for p in tmp_path.iterdir())
    for done in (aner("check", recipe), cli("run", recipe)):
        assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
        assert f"{len(expected)} problem(s) in {recipe}" in done.stderr, done.stderr
        reported = done.stderr.splitlines()[1:]
        assert len(reported) == len(expected), done.stderr
        for (key, message), line in zip(expected, reported):
            assert line.startswith(f"{recipe}:{lines[key]}: {message}"), (line, lines[key], message)
    assert sorted(p.name for p in tmp_path.iterdir()) == before        # nothing written


def test_check_refuses_combinations_and_overrides_report_their_origin(tmp_path, tiny, cli):
    full = tiny_recipe(tmp_path, tiny, "full.toml", method='name = "full"\nrank = 4',
                       output='directory = "run"\nadapter = "a"\nmerged = "m.gguf"\npeft = "m.gguf"')
    text = full.read_text().replace("[model]\n", '[model]\nstorage = "nf4"\n')
    full.write_text(text)
    done = cli("check", full, "--set", "training.steps=0", "--set", "model.device=gpu")
    problems = done.stderr.splitlines()[1:]
    assert done.returncode == 2 and len(problems) == 7, done.stderr
    expected = f":{line_of(text, 'rank')}: [method] rank: full fine-tuning takes no method arguments"
    assert any(expected in p for p in problems)
    assert any(f":{line_of(text, 'adapter')}: [output] adapter: a full fine-tune has no adapter" in p for p in problems)
    assert any("[output] peft: a full fine-tune has no adapter" in p for p in problems)
    assert any("[output] peft: 'm.gguf' is already the name of another output" in p for p in problems)
    assert any(f":{line_of(text, 'name')}: [method] name: full fine-tuning of an nf4 base is refused" in p
               for p in problems)
    assert any(p.startswith(f"{full} (--set training.steps): [training] steps: steps=0 is outside") for p in problems)
    assert any(p.startswith(f"{full} (--set model.device): [model] device: device='gpu' is not supported")
               for p in problems)
    broken = tmp_path / "broken.toml"
    broken.write_text("[model]\npath = \n")
    done = cli("check", broken)
    assert done.returncode == 2 and "not valid TOML" in done.stderr and "line 2" in done.stderr


# ---- running: Ctrl-C, exact resume, every output, export and conversion --------------------------

def test_ctrl_c_publishes_a_checkpoint_that_resumes_exactly(tmp_path, tiny, cli):
    """On a terminal (a pseudo-terminal here): the progress bar, then SIGINT after the first metrics line."""
    recipe = tiny_recipe(tmp_path, tiny, steps=100_000)
    log = tmp_path / "run" / "metrics.jsonl"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))    # rows, columns: a terminal's size
    proc = subprocess.Popen([str(ANER), "run", recipe], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        shown = read_pty(master, lambda _: log.is_file() and log.read_text().strip() or proc.poll() is not None)
        assert proc.poll() is None, shown.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        shown += read_pty(master, lambda _: False)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    shown = shown.decode(errors="replace")
    bar = r"training: +0%\|.*\| *\d+/100000 \[[\d:]+<[\d:]+,[^,]*, loss=\d+\.\d{4}, tok_s=\d+\]"
    assert re.search(bar, shown), shown
    assert "stopping at the next update boundary" in shown and "resumes exactly" in shown
    assert "result.model().checkpoint(" in shown and "model.save_model" not in shown
    updates, final = metrics(tmp_path / "run")
    stopped = final["updates"]
    assert final["status"] == "stopped" and 1 <= stopped < 100_000 and len(updates) == stopped
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == PNG
    assert gen.load_pretrained_checkpoint(tmp_path / "run" / "checkpoint").updates() == stopped

    resume = tmp_path / "resume.toml"
    resume.write_text(f'resume_from = "run/checkpoint"\n\n[data]\ntraining = "{EXAMPLES}/data/training.csv"\n'
                      f'validation = "{EXAMPLES}/data/validation.csv"\ncontext = 64\n\n[training]\nsteps = 2\n\n'
                      '[output]\ndirectory = "resumed"\ncheckpoint = "checkpoint"\n')
    done = cli("run", resume)
    assert done.returncode == 0, done.stderr
    assert [u["update"] for u in metrics(tmp_path / "resumed")[0]] == [stopped + 1, stopped + 2]
    resumed = gen.load_pretrained_checkpoint(tmp_path / "resumed" / "checkpoint")
    # one uninterrupted run of the same number of updates, in this process
    base = gen.import_model(tiny)
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    va = gen.supervised_csv(base, EXAMPLES / "data" / "validation.csv", role="validation", context=64)
    direct = base.lora(rank=2, seed=4).fine_tune(tr, va, steps=stopped + 2, **TINY_RUN)
    assert_same_state(resumed, direct)


def test_qlora_and_full_runs_then_export_convert_quantize(tmp_path, tiny, cli):
    qlora = tiny_recipe(tmp_path, tiny, "qlora.toml", method='name = "qlora"\nrank = 2',
                        output='directory = "q"\nadapter = "package"', extra='\n[profile]\npage_bytes = 8192\n')
    full = tiny_recipe(tmp_path, tiny, "full.toml", method='name = "full"', steps=2,
                       output='directory = "f"\ncheckpoint = "checkpoint"\nmerged = "m.gguf"\nq4_0 = "q4.gguf"\n'
                              'ollama = true', extra="\n[checkpoints]\nevery = 2\n")
    runs = [cli("run", recipe) for recipe in (qlora, full)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert "model = model.qlora(rank=2)\nmodel = model.with_training_profile(page_bytes=8192)\n" in runs[0].stdout
    assert "model = model." not in runs[1].stdout and "plan = model.fine_tune_plan(" in runs[1].stdout
    assert "plan = plan.checkpoints('" in runs[1].stdout
    assert gen.load_pretrained_checkpoint(tmp_path / "f" / "checkpoints" / "run-1" / "step-2").updates() == 2
    package = json.loads(cli("inspect", "--json", tmp_path / "q" / "package").stdout)
    assert package["kind"] == "adapter package" and package["storage"] == "nf4_double_quant"
    assert package["integrity"] == "verified: 4 files' SHA-256" and package["adapter"]["method"] == "lora"
    assert cli("generate", tmp_path / "q" / "package", "Hello", "--max-tokens", "3").returncode == 0
    assert "FROM ./q4.gguf" in (tmp_path / "f" / "Modelfile").read_text()

    ck, ex = tmp_path / "f" / "checkpoint", tmp_path / "export"
    ex.mkdir()
    done = cli("export", ck, "--merged", ex / "m.gguf", "--q4", ex / "q4.gguf", "--ollama")
    assert done.returncode == 0, done.stderr
    assert (ex / "m.gguf").read_bytes() == (tmp_path / "f" / "m.gguf").read_bytes()     # the same calls
    assert (ex / "q4.gguf").read_bytes() == (tmp_path / "f" / "q4.gguf").read_bytes()
    assert (ex / "Modelfile").read_text() == (tmp_path / "f" / "Modelfile").read_text()
    refused = cli("export", ck, "--adapter", ex / "a", "--merged", ex / "m.gguf")
    assert refused.returncode == 2 and "already exists" in refused.stderr and not (ex / "a").exists()
    refused = cli("export", ck, "--adapter", ex / "a")
    assert refused.returncode == 2 and "a full fine-tune has no adapter" in refused.stderr

    assert cli("convert", ex / "q4.gguf", ex / "back.gguf", "--dtype", "f32").returncode == 0
    assert cli("quantize", ex / "m.gguf", ex / "q8.gguf", "--format", "q8_0").returncode == 0
    back, q8 = (json.loads(s) for s in cli("inspect", "--json", ex / "back.gguf", ex / "q8.gguf").stdout.splitlines())
    assert back["tensor_types"] == {"F32": 20} and back["provenance"]["aner.method"] == "full"
    assert "Q8_0" in q8["tensor_types"]


def test_inspect_verifies_integrity(tmp_path, tiny_run, cli):
    shutil.copytree(tiny_run / "c", tmp_path / "c")
    shutil.copytree(tiny_run / "a", tmp_path / "a")
    ok = cli("inspect", tmp_path / "c", tmp_path / "a")
    assert ok.returncode == 0 and ok.stdout.count("integrity: verified") == 2
    for path in (tmp_path / "c" / "adapter.safetensors", tmp_path / "a" / "adapter.gguf"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    for folder in ("c", "a"):
        bad = cli("inspect", tmp_path / folder)
        assert bad.returncode == 2 and "does not match its SHA-256" in bad.stderr and "Traceback" not in bad.stderr
    neither = cli("inspect", tmp_path)
    assert neither.returncode == 2 and "is not a GGUF file, checkpoint" in neither.stderr


def test_generate_and_exit_statuses(tmp_path, tiny, cli, monkeypatch):
    chat = [{"role": "user", "content": "Hello there"}]
    with llm.load(tiny, context=64) as model:
        expected = model.generate("Hello there", max_tokens=6).text()
        # what the commands print: text pieces as they come, together exactly generate()'s / chat()'s text
        pieces = list(model.stream("Hello there", max_tokens=6))
        assert len(pieces) > 1 and "".join(pieces) == expected
        pieces = list(model.stream_chat(chat, max_tokens=6))
        assert len(pieces) > 1 and "".join(pieces) == model.chat(chat, max_tokens=6).text()
    done = aner("generate", tiny, "Hello there", "--max-tokens", "6", "--context", "64")
    assert done.returncode == 0 and done.stdout == expected + "\n"
    too_long = cli("generate", tiny, "Hello", "--max-tokens", "100", "--context", "64")
    assert too_long.returncode == 2 and "max_tokens=100 does not fit" in too_long.stderr
    with pytest.raises(SystemExit) as usage:                  # argparse: a usage error
        main(["frobnicate"])
    assert usage.value.code == 2
    # an internal error is not an AnerError: main lets it go, and Python exits with status 1
    def boom(args):
        raise RuntimeError("boom")
    monkeypatch.setattr("aner.cli.convert", boom)
    with pytest.raises(RuntimeError, match="boom"):
        main(["convert", "a", "b"])
