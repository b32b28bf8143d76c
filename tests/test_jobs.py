"""Plans, background jobs and results on a tiny random Llama with the example chat data.

Every job runs on the one process-wide worker; each test waits for or stops the jobs it started,
so the next test finds the executor idle. A job of LONG steps stands for work that would outlast
the test: it only ends because the test stops it.
"""
import dataclasses
import gc
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
import torch

from aner import AnerError, gen
from aner.errors import ArtifactError, ConfigError, ResourceError
from aner.jobs import _EXECUTOR, MAX_REQUESTS, MAX_WAITING, JobTimeoutError
from aner.train.loop import MAX_STEPS, RunConfig, TrainState, window
from conftest import EXAMPLES
from fixtures import assert_same_state

KW = dict(micro_batch=2, accumulation=1, rate=1e-3, seed=3)
LONG = MAX_STEPS


def until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.005)


@pytest.fixture
def blocker(base, data):
    """A running job that holds the worker until the test ends."""
    tr, va = data
    job = base.lora(rank=2).fine_tune_plan(tr, va, steps=LONG, **KW).start()
    until(lambda: job.status() == "running")
    yield job
    job.stop()
    assert job.wait(timeout=60).status() == "stopped"




def scored_after(training, updates: int) -> int:
    """Scored tokens of the first `updates` windows of a KW run, replayed from the sample order."""
    state, total = TrainState(RunConfig(**KW), "", ""), 0
    for _ in range(updates):
        w = window(state, training.examples())
        total += sum(training.items[i].scored for i in w)
        state = replace(state, cursor=state.cursor + len(w))
    return total


# ---- plans -----------------------------------------------------------------------------------

def test_plans_validate_when_created(base, data, tmp_path):
    tr, va = data
    src = base.lora(rank=2)
    cases = [(dict(steps=0), "steps=0"), (dict(micro_batch=0), "micro_batch=0"), (dict(rate=2.0), "rate=2.0"),
             (dict(accumulation=5000), "accumulation=5000"), (dict(seed=-1), "seed=-1"),
             (dict(clip_norm=-1.0), "clip_norm=-1.0")]
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message):
            src.fine_tune_plan(tr, va, **(dict(steps=1) | kw))
    with pytest.raises(ConfigError, match="training data has role='validation'"):
        src.fine_tune_plan(va, va, steps=1)
    overlap = tmp_path / "overlap.csv"
    overlap.write_text("question,answer\nWhat is the capital of Tolvara?,The capital of Tolvara is Brisk Harbor.\n")
    with pytest.raises(ConfigError, match=r"validation example\(s\) \[1\]"):
        src.fine_tune_plan(tr, gen.supervised_csv(base, overlap, role="validation", context=64), steps=1)
    with pytest.raises(ConfigError, match="resume needs a trained model"):
        src.resume_plan(tr, va, steps=1)

    plan = src.fine_tune_plan(tr, va, steps=3, **KW)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps = 4
    assert "operation=fine_tune; steps=3; start_updates=0; micro_batch=2; accumulation=1; rate=0.001; seed=3" \
        in plan.summary() and "checkpoints=none" in plan.summary()
    assert plan.memory_summary() == src.memory_summary()

    with pytest.raises(ArtifactError, match="does not exist"):
        plan.checkpoints(directory=tmp_path / "absent", every=1)
    with pytest.raises(ConfigError, match="every=0 is outside"):
        plan.checkpoints(directory=tmp_path, every=0)
    with pytest.raises(ConfigError, match="every=4 publishes no checkpoint in this plan's updates 1..3"):
        plan.checkpoints(directory=tmp_path, every=4)
    scheduled = plan.checkpoints(directory=tmp_path, every=2)
    assert plan.directory is None and scheduled.every == 2
    assert f"checkpoints='{tmp_path}' every 2" in scheduled.summary()


# ---- running, observing, stopping ------------------------------------------------------------

@pytest.mark.parametrize("select", ["full", "lora"])
def test_job_result_equals_synchronous_fine_tune(base, data, tmp_path, select):
    tr, va = data
    src = base if select == "full" else base.lora(rank=2, seed=4)
    before = {k: v.clone() for k, v in (src._weights | src._adapter_tensors).items()}
    job = src.fine_tune_plan(tr, va, steps=2, **KW).start()
    assert job.status() in ("queued", "running", "completed")
    result = job.wait(timeout=120)
    direct = src.fine_tune(tr, va, steps=2, **KW)
    assert (job.status(), result.status(), result.error()) == ("completed", "completed", None)
    assert result.updates() == job.updates() == 2 and result.checkpoints() == ()
    assert result.scored_tokens() == job.scored_tokens() == direct.scored_tokens() == scored_after(tr, 2)
    assert_same_state(result.model(), direct)
    assert result.validation_loss() == direct.validation_loss()
    assert "status=completed; updates=2/2" in result.summary() and "error=None" in result.summary()
    after = src._weights | src._adapter_tensors
    assert all(torch.equal(before[k], after[k]) for k in before) and src.updates() == 0
    # a manual checkpoint of a finished job publishes its final model
    assert_same_state(gen.load_pretrained_checkpoint(job.checkpoint(tmp_path / "final")), direct)


def test_stop_takes_effect_at_an_update_boundary(base, data):
    tr, va = data
    src = base.lora(rank=2, seed=1)
    job = src.fine_tune_plan(tr, va, steps=LONG, **KW).start()
    until(lambda: job.updates() >= 2)
    with pytest.raises(JobTimeoutError, match="still running") as timeout:
        job.wait(timeout=0.01)
    assert isinstance(timeout.value, TimeoutError) and isinstance(timeout.value, AnerError)
    with pytest.raises(ConfigError, match="timeout=-1"):
        job.wait(timeout=-1)
    seen = [job.progress() for _ in range(20)]
    # every snapshot is one boundary: its token count is exactly that of its number of updates
    assert all(p.status == "running" and p.steps == LONG and p.scored_tokens == scored_after(tr, p.updates)
               for p in seen)
    job.stop()
    result = job.wait(timeout=60)
    assert (result.status(), job.status()) == ("stopped", "stopped")
    assert seen[-1].updates <= result.updates() < LONG
    assert f"updates={result.updates()}/{LONG}" in result.summary()
    # the model as of the last committed update, evaluated: exactly a run of that many updates
    direct = src.fine_tune(tr, va, steps=result.updates(), **KW)
    assert_same_state(result.model(), direct)
    assert result.validation_loss() == direct.validation_loss()
    assert result.scored_tokens() == direct.scored_tokens()


def test_stop_while_queued_keeps_the_source(base, data, blocker, tmp_path):
    tr, va = data
    src = base.lora(rank=2, seed=2)
    job = src.fine_tune_plan(tr, va, steps=3, **KW).start()
    assert job.status() == "queued" and job.updates() == 0
    # a manual checkpoint waits while the job is queued ...
    published = []
    caller = threading.Thread(target=lambda: published.append(job.checkpoint(tmp_path / "queued")))
    caller.start()
    until(lambda: len(job._record.requests) == 1)
    job.stop()
    caller.join(timeout=60)
    result = job.wait(timeout=0)
    assert (result.status(), result.updates(), result.scored_tokens()) == ("stopped", 0, 0)
    assert result.model() is src and result.error() is None
    with pytest.raises(ConfigError, match="no validation loss: it was stopped before it ran"):
        result.validation_loss()
    assert blocker.status() == "running"
    # ... and a job stopped there publishes its unchanged source
    loaded = gen.load_pretrained_checkpoint(published[0])
    assert loaded.updates() == 0 and loaded._state is None
    assert all(torch.equal(loaded._adapter_tensors[k], v) for k, v in src._adapter_tensors.items())


def test_the_executor_holds_64_waiting_jobs_on_one_thread(base, data, blocker):
    tr, va = data
    plan = base.lora(rank=2).fine_tune_plan(tr, va, steps=1, **KW)
    threads = threading.active_count()
    waiting = [plan.start() for _ in range(MAX_WAITING)]
    assert len(waiting) == 64 and all(j.status() == "queued" for j in waiting)
    with pytest.raises(ResourceError, match="already holds 64 waiting jobs"):
        plan.start()
    assert threading.active_count() == threads
    assert [t.name for t in threading.enumerate()].count("aner-jobs") == 1
    waiting[0].stop()                       # a stopped queued job gives its place back at once
    waiting.append(plan.start())
    for job in waiting:
        job.stop()
    assert [job.wait(timeout=0).status() for job in waiting] == ["stopped"] * 65


def test_releasing_the_last_handle_requests_a_stop(base, data):
    tr, va = data
    plan = base.lora(rank=2).fine_tune_plan(tr, va, steps=LONG, **KW)
    running = plan.start()
    until(lambda: running.updates() >= 1)
    queued = plan.start()
    records = running._record, queued._record
    del running, queued
    gc.collect()
    first, second = (_EXECUTOR.wait(r, timeout=60) for r in records)
    assert first.status() == "stopped" and 1 <= first.updates() < LONG
    assert (second.status(), second.updates()) == ("stopped", 0)
    # the executor moves on; a handle kept alive by the call on it is not released
    assert base.lora(rank=2).fine_tune_plan(tr, va, steps=1, **KW).start().wait(timeout=60).status() == "completed"


# ---- checkpoints -----------------------------------------------------------------------------

def test_automatic_and_manual_checkpoints_resume_exactly(base, data, tmp_path):
    tr, va = data
    (tmp_path / "run-1").mkdir()                 # an earlier run: never reused or touched
    (tmp_path / "run-1" / "keep").write_text("earlier")
    plan = base.lora(rank=2, seed=6).fine_tune_plan(tr, va, steps=4, **KW).checkpoints(tmp_path, every=2)
    job = plan.start()
    manual = gen.load_pretrained_checkpoint(job.checkpoint(tmp_path / "manual"))  # at the next boundary
    result = job.wait(timeout=120)
    assert result.status() == "completed"
    run = tmp_path / "run-2"
    assert result.checkpoints() == (str(run / "step-2"), str(run / "step-4"))
    assert sorted(p.name for p in run.iterdir()) == ["step-2", "step-4"]
    assert (tmp_path / "run-1" / "keep").read_text() == "earlier"

    step2 = gen.load_pretrained_checkpoint(run / "step-2")
    assert step2.updates() == 2
    with pytest.raises(ConfigError, match="no validation loss"):
        step2.validation_loss()              # published mid-run: no evaluation of those weights
    resumed = step2.resume_plan(tr, va, steps=2).start().wait(timeout=120)
    assert (resumed.updates(), resumed.model().updates()) == (2, 4)   # job counters count this run
    assert_same_state(resumed.model(), result.model())
    assert 1 <= manual.updates() <= 4
    if manual.updates() < 4:
        assert_same_state(manual.resume(tr, va, steps=4 - manual.updates()), result.model())
    else:                                    # served from the final model
        assert_same_state(manual, result.model())
    # continuing the evaluated final model: another fresh run folder, named by the model's counter,
    # and no stale validation loss carried into the mid-run checkpoint
    assert result.model().validation_loss() is not None
    more = result.model().resume_plan(tr, va, steps=1).checkpoints(tmp_path, every=1).start().wait(timeout=120)
    assert more.checkpoints() == (str(tmp_path / "run-3" / "step-5"),)
    with pytest.raises(ConfigError, match="no validation loss"):
        gen.load_pretrained_checkpoint(more.checkpoints()[0]).validation_loss()


def test_a_manual_checkpoint_error_affects_only_its_request(blocker, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ArtifactError, match="already exists"):
        blocker.checkpoint(tmp_path / "taken")
    assert blocker.status() == "running"
    published = gen.load_pretrained_checkpoint(blocker.checkpoint(tmp_path / "ok"))
    until(lambda: blocker.updates() > published.updates())       # the job went on
    assert blocker.status() == "running"


def test_checkpoint_requests_are_bounded(base, data, blocker, tmp_path):
    tr, va = data
    job = base.lora(rank=2).fine_tune_plan(tr, va, steps=1, **KW).start()     # queued behind the blocker
    errors = []

    def request(i):
        try:
            job.checkpoint(tmp_path / "absent" / f"c{i}")
        except AnerError as e:
            errors.append(e)

    callers = [threading.Thread(target=request, args=(i,)) for i in range(MAX_REQUESTS)]
    for c in callers:
        c.start()
    until(lambda: len(job._record.requests) == 8)
    with pytest.raises(ResourceError, match="8 pending checkpoint requests"):
        job.checkpoint(tmp_path / "ninth")
    job.stop()
    for c in callers:
        c.join(timeout=60)
    assert len(errors) == 8 and all(isinstance(e, ArtifactError) and "does not exist" in str(e) for e in errors)


# ---- failures --------------------------------------------------------------------------------

def test_admission_at_execution_gives_a_failed_result(tiny, data, tmp_path):
    tr, va = data
    small = gen.import_model(tiny, max_memory_bytes=30 << 20)
    plan = small.lora(rank=2).fine_tune_plan(tr, va, steps=2)      # a valid configuration: accepted
    job = plan.start()
    result = job.wait(timeout=60)
    assert (result.status(), job.status(), result.updates()) == ("failed", "failed", 0)
    assert result.error().startswith("ResourceError: training needs an estimated")
    assert "status=failed" in result.summary()
    with pytest.raises(ConfigError, match="a failed result has no model") as refused:
        result.model()
    assert isinstance(refused.value.__cause__, ResourceError)
    with pytest.raises(ConfigError, match="no validation loss: it failed"):
        result.validation_loss()
    with pytest.raises(ConfigError, match="no model to checkpoint"):
        job.checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_an_automatic_checkpoint_failure_fails_the_job(base, data, tmp_path):
    tr, va = data
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    plan = base.lora(rank=2).fine_tune_plan(tr, va, steps=3, **KW).checkpoints(directory, every=1)
    directory.rmdir()                            # gone between planning and publication
    result = plan.start().wait(timeout=60)
    assert result.status() == "failed" and result.updates() == 1 and result.checkpoints() == ()
    assert result.error().startswith("ArtifactError: ") and str(directory) in result.error()


def test_exit_stops_jobs_and_waits_for_the_boundary(tiny, tmp_path):
    """A worker left inside torch while the interpreter finalizes aborts the process (exit status
    134, "terminate called without an active exception"); exit stops jobs and waits instead."""
    script = textwrap.dedent(f"""
        import time
        from aner import gen
        base = gen.import_model({str(tiny)!r})
        data = {str(EXAMPLES / "data")!r}
        tr = gen.supervised_csv(base, data + "/training.csv", role="training", context=64)
        va = gen.supervised_csv(base, data + "/validation.csv", role="validation", context=64)
        plan = base.lora(rank=2).fine_tune_plan(tr, va, steps={LONG})
        running, queued = plan.start(), plan.start()
        while running.updates() < 1:
            time.sleep(0.01)
        print("exiting while", running.status(), queued.status(), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "exiting while running queued\n"), done.stderr[-2000:]
