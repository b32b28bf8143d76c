"""Training plans, background jobs and their results: prepare work, run it, observe its outcome.

    plan = model.fine_tune_plan(training, validation, steps=20, accumulation=4)   # validated now
    job = plan.checkpoints(directory="checkpoints", every=5).start()              # queued
    job.status(); job.updates(); job.history(); job.checkpoint("manual-1"); job.stop()  # observe, steer
    result = job.wait()                  # a PretrainedResult, also for a failed run
    result.model() if result.status() != "failed" else result.error()

One process-wide executor runs the jobs: a single worker thread, started by the first `start()`,
runs one job at a time and holds at most `MAX_WAITING` (64) waiting jobs; no thread per job.

Boundaries. Everything a job does to the outside happens at a committed update boundary, on the
worker thread, between two optimizer updates: the counters move, automatic checkpoints publish,
manual checkpoint requests are served and a stop takes effect. Nothing interrupts an update. A
job that has started commits at least one update (the first boundary comes after it).

Semantics chosen here (the seed leaves them open):
- Counters (`updates`, `scored_tokens`) count this job's committed updates and the scored
  training tokens in them; the model's own counters (cumulative over a resumed run) are
  `result.model().updates()`.
- A stopped job's model is the model as of its last committed update, with its exact TrainState
  (a checkpoint of it resumes like any other), and it is evaluated on the validation data like a
  completed one, so `validation_loss()` works.
- A job stopped while queued never ran: its result is `stopped` with 0 updates, its model is the
  unchanged source handle itself, and it has no validation loss (no evaluation ran).
- Automatic checkpoints publish when the model's cumulative update counter is a multiple of
  `every`, into `<directory>/run-<n>/step-<updates>`: `run-<n>` is created (atomically, never
  reused) at the job's first automatic checkpoint. They carry no validation loss.
- The data checks (roles, tokenizer identity, overlap, a resume's exact data) run when the plan
  is created, on immutable inputs. Memory admission runs on the worker, before any training
  state is copied or changed, so a plan that passed its checks can still give a failed result.
- At interpreter exit every job is stopped: queued ones at once, the running one at its next
  boundary (it then finishes its validation evaluation), and the exit waits for that. A daemon
  worker left running torch operations while the interpreter finalizes aborts the process
  (exit status 134, "terminate called without an active exception", measured here), so the worker is a daemon
  only so that an idle one never delays exit. Call `job.wait()` for work that must finish.
"""
import atexit
import dataclasses
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .errors import AnerError, ArtifactError, ConfigError, ResourceError

MAX_WAITING = 64          # queued jobs the executor holds besides the running one
MAX_REQUESTS = 8          # pending manual checkpoint requests per job


class JobTimeoutError(AnerError, TimeoutError):
    """job.wait(timeout) ran out before the job finished (the job itself is unaffected)."""


# ---- plans ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PretrainedPlan:
    """A validated training run that has not started. Build it with `model.fine_tune_plan(...)` or
    `model.resume_plan(...)`, which run the same checks as fine_tune/resume."""
    source: object            # the PretrainedModel to train (never changed)
    operation: str            # "fine_tune" (new optimizer run) or "resume" (continue the saved one)
    training: object
    validation: object
    state: object             # TrainState the run starts from
    steps: int
    directory: Path | None = None   # automatic checkpoints, or None
    every: int | None = None

    def checkpoints(self, directory, every) -> "PretrainedPlan":
        """A new plan that publishes a checkpoint every `every` updates into a fresh run folder
        inside `directory`, which must already exist."""
        from .train.loop import MAX_STEPS
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_STEPS:
            raise ConfigError(f"every={every!r} is outside the accepted range 1..{MAX_STEPS}")
        first, last = self.state.updates + 1, self.state.updates + self.steps
        if last // every * every < first:
            raise ConfigError(f"every={every!r} publishes no checkpoint in this plan's updates {first}..{last}; "
                              f"accepted: 1..{self.steps} (or any value with a multiple in that range)")
        directory = Path(directory)
        if not directory.is_dir():
            raise ArtifactError(f"checkpoint directory {str(directory)!r} does not exist or is not a folder; "
                                "create it first (each run publishes into a fresh child folder)")
        return dataclasses.replace(self, directory=directory, every=every)

    def start(self) -> "PretrainedJob":
        """Queue the run on the local executor; refused with ResourceError when 64 jobs wait."""
        return PretrainedJob(_EXECUTOR.submit(self))

    def summary(self) -> str:
        r = self.state.run
        schedule = f"{str(self.directory)!r} every {self.every}" if self.directory else "none"
        return (f"Pretrained plan; operation={self.operation}; steps={self.steps}; "
                f"start_updates={self.state.updates}; micro_batch={r.micro_batch}; "
                f"accumulation={r.accumulation}; rate={r.rate}; seed={r.seed}; clip_norm={r.clip_norm}; "
                f"method={self.source.method()}; training_sha256={self.state.training_sha256}; "
                f"validation_sha256={self.state.validation_sha256}; checkpoints={schedule}")

    def memory_summary(self):
        """The source model's accounting (not a measured peak for this plan's batch and context)."""
        return self.source.memory_summary()

    def __repr__(self):
        return f"<PretrainedPlan {self.summary()}>"


# ---- results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PretrainedResult:
    """The outcome of a job: typed for every status, including failure."""
    _status: str
    _updates: int
    _scored_tokens: int
    _steps: int
    _model: object = None          # None for a failed run
    _exception: BaseException | None = None
    _evaluated: bool = False       # a validation evaluation of _model completed in this run
    _checkpoints: tuple = ()

    def status(self) -> str:
        return self._status

    def exception(self) -> BaseException | None:
        """What failed the run (the original exception), or None."""
        return self._exception

    def error(self) -> str | None:
        """`<ErrorType>: <message>` of what failed the run; None unless status() == 'failed'."""
        e = self._exception
        return None if e is None else f"{type(e).__name__}: {e}"

    def updates(self) -> int:
        return self._updates

    def scored_tokens(self) -> int:
        return self._scored_tokens

    def checkpoints(self) -> tuple[str, ...]:
        """Paths of the automatic checkpoints this run published, in order."""
        return self._checkpoints

    def model(self):
        if self._model is None:
            raise ConfigError(f"this run failed ({self.error()}); a failed result has no model: "
                              "read error()") from self._exception
        return self._model

    def validation_loss(self) -> float:
        if not self._evaluated:
            why = "it failed" if self._status == "failed" else "it was stopped before it ran"
            raise ConfigError(f"this result has no validation loss: {why}, so no evaluation completed")
        return self._model.validation_loss()

    def summary(self) -> str:
        loss = f"{self._model.validation_loss():.6f}" if self._evaluated else "none"
        return (f"Pretrained result; status={self._status}; updates={self._updates}/{self._steps}; "
                f"scored_tokens={self._scored_tokens}; validation_loss={loss}; "
                f"checkpoints={len(self._checkpoints)}; error={self.error()}")

    def __repr__(self):
        return f"<PretrainedResult {self.summary()}>"


# ---- jobs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobProgress:
    """One consistent snapshot of a job, taken at an update boundary."""
    status: str
    updates: int
    scored_tokens: int
    steps: int


@dataclass(frozen=True)
class UpdateRecord:
    """One committed update of a job, as `job.history()` reports it (live metrics, plots)."""
    update: int             # the model's cumulative update counter after this update
    loss: float             # its training loss (token-weighted over its window)
    scored_tokens: int      # scored training tokens in its window
    seconds: float          # since the job started running, when the update committed


class _Request:
    """One manual checkpoint request; served by the worker or, once the job ended, by its caller."""

    def __init__(self, path: Path):
        self.path, self.done, self.error = path, False, None


class _Record:
    """The executor's side of a job. It never refers to the PretrainedJob handle, so dropping the
    last handle lets the handle's finalizer request a stop."""

    def __init__(self, plan: PretrainedPlan):
        self.plan = plan
        self.status = "queued"
        self.updates = 0
        self.scored_tokens = 0
        self.stop_requested = False     # set without the lock (by a finalizer); read at boundaries
        self.requests: deque[_Request] = deque()
        self.checkpoints: list[str] = []
        self.history: list[UpdateRecord] = []
        self.started = 0.0              # time.perf_counter() when the job started running
        self.run_dir: Path | None = None
        self.result: PretrainedResult | None = None

    def release(self) -> None:
        # Runs from a weakref finalizer, possibly inside a garbage collection triggered while this
        # very thread holds the executor lock: so it only sets a flag (atomic), never locks.
        self.stop_requested = True


class PretrainedJob:
    """A handle on a queued, running or finished plan. Dropping the last reference to it requests
    a cooperative stop: keep it while the work should continue."""

    def __init__(self, record: _Record):
        self._record = record
        weakref.finalize(self, record.release)

    def status(self) -> str:
        return self.progress().status

    def updates(self) -> int:
        return self.progress().updates

    def scored_tokens(self) -> int:
        return self.progress().scored_tokens

    def progress(self) -> JobProgress:
        return _EXECUTOR.progress(self._record)

    def history(self, start: int = 0) -> tuple[UpdateRecord, ...]:
        """This job's committed updates from the `start`-th on (0: all), in order."""
        return _EXECUTOR.history(self._record, start)

    def stop(self) -> None:
        """Stop at the next committed update boundary (a queued job is removed at once)."""
        _EXECUTOR.stop(self._record)

    def wait(self, timeout=None) -> PretrainedResult:
        """Block until the job ends; its result, whatever the status. JobTimeoutError on timeout."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not (math.isfinite(timeout) and timeout >= 0)):
            raise ConfigError(f"timeout={timeout!r}; accepted: None or a finite number of seconds >= 0")
        return _EXECUTOR.wait(self._record, timeout)

    def checkpoint(self, directory) -> str:
        """Publish a checkpoint at `directory` (a new path) from the model at the job's next update
        boundary, or from its final model once it ended; block until published. An error is raised
        here and does not affect the job."""
        return _EXECUTOR.checkpoint(self._record, Path(directory))

    def summary(self) -> str:
        p = self.progress()
        return f"Pretrained job; status={p.status}; updates={p.updates}/{p.steps}; scored_tokens={p.scored_tokens}"

    def __repr__(self):
        return f"<PretrainedJob {self.summary()}>"


# ---- the executor -----------------------------------------------------------------------------

class _Executor:
    """One worker thread, one running job, a bounded FIFO of waiting ones. One condition guards
    every record's mutable fields, so status and counters are read as consistent snapshots."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: deque[_Record] = deque()
        self._thread: threading.Thread | None = None
        self._running: _Record | None = None
        self._closed = False

    def submit(self, plan: PretrainedPlan) -> _Record:
        assert isinstance(plan, PretrainedPlan)
        record = _Record(plan)
        with self._cond:
            if self._closed:
                raise ResourceError("the local executor is shut down: the interpreter is exiting")
            self._drop_released()
            if len(self._queue) >= MAX_WAITING:
                raise ResourceError(f"the local executor already holds {len(self._queue)} waiting jobs "
                                    f"(accepted: at most {MAX_WAITING} besides the running one); "
                                    "wait for or stop a job first")
            self._queue.append(record)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="aner-jobs", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return record

    def _drop_released(self) -> None:
        """Finish queued jobs whose stop was requested without the lock (a released handle)."""
        for record in [r for r in self._queue if r.stop_requested]:
            self._queue.remove(record)
            self._finish(record, _never_ran(record))

    def _finish(self, record: _Record, result: PretrainedResult) -> None:
        """Make `record` terminal (lock held). Unserved requests are left to their callers."""
        record.status, record.result = result.status(), result
        record.requests.clear()
        self._cond.notify_all()

    def progress(self, record: _Record) -> JobProgress:
        with self._cond:
            return JobProgress(record.status, record.updates, record.scored_tokens, record.plan.steps)

    def history(self, record: _Record, start: int) -> tuple[UpdateRecord, ...]:
        with self._cond:
            return tuple(record.history[start:])

    def stop(self, record: _Record) -> None:
        with self._cond:
            record.stop_requested = True
            if record.status == "queued":
                self._queue.remove(record)
                self._finish(record, _never_ran(record))

    def wait(self, record: _Record, timeout) -> PretrainedResult:
        with self._cond:
            if not self._cond.wait_for(lambda: record.result is not None, timeout):
                raise JobTimeoutError(f"the job is still {record.status} after timeout={timeout!r} s "
                                      f"({record.updates}/{record.plan.steps} updates)")
            return record.result

    def checkpoint(self, record: _Record, path: Path) -> str:
        request = _Request(path)
        with self._cond:
            if record.result is None:
                if len(record.requests) >= MAX_REQUESTS:
                    raise ResourceError(f"this job already has {len(record.requests)} pending checkpoint "
                                        f"requests (accepted: at most {MAX_REQUESTS}); wait for one first")
                record.requests.append(request)
                self._cond.wait_for(lambda: request.done or record.result is not None)
            result = record.result
        if request.done:
            if request.error is not None:
                raise request.error
            return str(path)
        # The job ended before a boundary served the request: publish from its final model here.
        if result.status() == "failed":
            raise ConfigError(f"the job failed ({result.error()}) before publishing {str(path)!r}: "
                              "a failed job has no model to checkpoint") from result._exception
        return result.model().checkpoint(path)

    # -- the worker thread --

    def _work(self) -> None:
        while True:
            with self._cond:
                self._drop_released()       # right before the pop: a released queued job never starts
                while not self._queue and not self._closed:
                    self._cond.wait()
                    self._drop_released()
                if self._closed:
                    return
                record = self._running = self._queue.popleft()
                record.status = "running"
                record.started = time.perf_counter()
                self._cond.notify_all()
            result = self._execute(record)
            with self._cond:
                self._finish(record, result)
                self._running = None

    def shutdown(self) -> None:
        """At exit: stop every job (the running one at its next boundary) and join the worker."""
        with self._cond:
            self._closed = True
            for record in self._queue:
                record.stop_requested = True
            self._drop_released()
            if self._running is not None:
                self._running.stop_requested = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def _execute(self, record: _Record) -> PretrainedResult:
        plan = record.plan
        try:
            model = plan.source._train(plan.training, plan.validation, plan.state, plan.steps, progress=False,
                                       on_update=lambda state, view: self._boundary(record, state, view))
        except Exception as e:  # every failure becomes the job's typed result
            with self._cond:
                return PretrainedResult("failed", record.updates, record.scored_tokens, plan.steps,
                                        _exception=e, _checkpoints=tuple(record.checkpoints))
        with self._cond:
            status = "completed" if record.updates == plan.steps else "stopped"
            return PretrainedResult(status, record.updates, record.scored_tokens, plan.steps, model,
                                    _evaluated=True, _checkpoints=tuple(record.checkpoints))

    def _boundary(self, record: _Record, state, view) -> bool:
        """After each committed update, on the worker: counters, automatic then manual checkpoints,
        and whether to go on. An automatic checkpoint error propagates and fails the job."""
        plan = record.plan
        with self._cond:
            tokens = state.scored_tokens - plan.state.scored_tokens - record.scored_tokens
            record.history.append(UpdateRecord(state.updates, state.losses[-1], tokens,
                                               time.perf_counter() - record.started))
            record.updates = state.updates - plan.state.updates
            record.scored_tokens = state.scored_tokens - plan.state.scored_tokens
            requests = list(record.requests)
            record.requests.clear()
            self._cond.notify_all()
        if plan.every is not None and state.updates % plan.every == 0:
            path = self._automatic_path(record, state.updates)
            try:
                view().checkpoint(path)
            except AnerError:
                raise
            except Exception as e:  # an OS error of the publication, named with its path
                raise ArtifactError(f"automatic checkpoint {str(path)!r} failed: {e}") from e
            with self._cond:
                record.checkpoints.append(str(path))
        for request in requests:
            error = None
            try:
                view().checkpoint(request.path)
            except AnerError as e:
                error = e
            except Exception as e:  # only this request fails; the job continues
                error = ArtifactError(f"checkpoint {str(request.path)!r} failed: {e}")
                error.__cause__ = e
            with self._cond:
                request.done, request.error = True, error
                self._cond.notify_all()
        return not record.stop_requested

    @staticmethod
    def _automatic_path(record: _Record, updates: int) -> Path:
        if record.run_dir is None:
            record.run_dir = _fresh_run(record.plan.directory)
        return record.run_dir / f"step-{updates}"


def _fresh_run(directory: Path) -> Path:
    """Create and return `directory/run-<n>` with n above every existing run-<k>: never reused."""
    try:
        taken = [int(p.name[4:]) for p in directory.iterdir() if p.name.startswith("run-") and p.name[4:].isdigit()]
    except OSError as e:
        raise ArtifactError(f"automatic checkpoint directory {str(directory)!r} cannot be read: "
                            f"{e.strerror or e}") from e
    n = max(taken, default=0) + 1
    while True:
        path = directory / f"run-{n}"
        try:
            os.mkdir(path)          # atomic: another writer's run-<n> makes us take the next number
            return path
        except FileExistsError:
            n += 1
        except OSError as e:
            raise ArtifactError(f"automatic checkpoint folder {str(path)!r} cannot be created: "
                                f"{e.strerror or e}") from e


def _never_ran(record: _Record) -> PretrainedResult:
    """The result of a job stopped while queued: no update, the unchanged source, no evaluation."""
    return PretrainedResult("stopped", 0, 0, record.plan.steps, record.plan.source)


_EXECUTOR = _Executor()
atexit.register(_EXECUTOR.shutdown)
