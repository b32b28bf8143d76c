"""PretrainedModel: an immutable handle on a Llama, its storage, adapter and training state.

Every selection and every training call returns a new handle; the source stays usable and
bitwise unchanged. Frozen tensors (a base under an adapter) are shared between handles, never
written; training works on private copies of what it updates and publishes them as a new handle.
"""
import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import ConfigError
from ..kernels import joins_deltas
from ..train.memory import MemorySummary, activation_bytes, adapter_activation_bytes, admit
from ..train.profile import Profile
from . import names
from .build import build
from .config import LlamaConfig

BACKEND_NAME = "aner.llama-trainer/1"


@dataclass(frozen=True)
class Source:
    """Identity of the floating GGUF a model was imported from."""
    path: str                   # where it was read from (informational)
    sha256: str                 # SHA-256 of the file's bytes
    canonical_sha256: str       # over tensor names, shapes and FP32 values in canonical order
    tokenizer_sha256: str       # over the tokenizer.* metadata
    config: LlamaConfig
    fields: tuple               # every metadata Field, carried to exports
    metadata_path: str          # a GGUF holding these fields (the source, or a checkpoint's copy)


class CanonicalHash:
    """canonical_sha256 fed one tensor at a time, in canonical order: streamed imports and exports
    hash each matrix while it is in memory and then drop it. Order and shapes are checked."""

    def __init__(self, config):
        self._h = hashlib.sha256(b"aner.canonical/1")
        self._expected = iter(names.expected(config).items())

    def update(self, name: str, values) -> None:
        """values: the tensor's FP32 values (torch tensor or numpy array), hashed without a copy."""
        expected, (_, _, shape) = next(self._expected, (None, (None, None, None)))
        assert name == expected and tuple(values.shape) == tuple(shape), (name, expected, values.shape, shape)
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        self._h.update(f"{name}:{tuple(shape)};".encode())
        self._h.update(np.ascontiguousarray(values, dtype="<f4"))

    def hexdigest(self) -> str:
        assert next(self._expected, None) is None, "not every tensor was hashed"
        return self._h.hexdigest()


def canonical_sha256(config, weights: dict) -> str:
    h = CanonicalHash(config)
    for name in names.expected(config):
        h.update(name, weights[name])
    return h.hexdigest()


def _paired(target: str, targets) -> bool:
    """Whether an adapted gate or up is paired with its layer's other for the SwiGLU inside their
    GEMM (`kernels.lora.gated_mlp`): the layer's gate, up and down all adapted."""
    layer, _, name = target.rpartition(".ffn_")
    return name in ("gate.weight", "up.weight") \
        and all(f"{layer}.ffn_{n}.weight" in targets for n in ("gate", "up", "down"))


def check_device(device) -> str:
    if device == "cpu":
        return device
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        from ..train.device import require_cuda
        require_cuda(device)
        return device
    raise ConfigError(f"device={device!r} is not supported; accepted: 'cpu' or 'cuda:N'")


class PretrainedModel:
    """See `aner.gen.import_model`. Methods mirror the seed's `gen.pretrained_*` operations."""

    def __init__(self, *, source: Source, weights: dict, device: str, budget: int, storage="float32",
                 method=None, adapter_tensors=None, state=None, lineage=(), lineage_examples=frozenset(),
                 profile=None, device_copies=None):
        self._source = source
        self._weights = weights            # name -> FP32 tensor (or packed weight); never mutated
        self._device = device
        self._budget = budget
        self._storage = storage
        self._method = method              # adapters.base.Method or None (full)
        self._adapter_tensors = adapter_tensors or {}
        self._state = state                # train.loop.TrainState or None
        self._lineage = tuple(lineage)     # SHA-256 of every training set this model has learned from
        self._lineage_examples = frozenset(lineage_examples)
        self._profile = profile or Profile()
        self._module = None
        # The fused or decoded NF4 kernels' immutable GPU copy of each packed matrix; the host
        # buffers stay authoritative (checkpoints, identity). Made once and shared by derived handles.
        if device_copies is None and self._profile.packed_on_device and storage != "float32":
            from ..kernels.nf4 import DevicePacked
            transposed = self._profile.transposed_on_device
            device_copies = {n: DevicePacked.from_weight(w, device, transposed) for n, w in weights.items()
                             if not isinstance(w, torch.Tensor)}
        self._device_copies = device_copies or {}

    def _derive(self, **changes) -> "PretrainedModel":
        kw = dict(source=self._source, weights=self._weights, device=self._device, budget=self._budget,
                  storage=self._storage, method=self._method, adapter_tensors=self._adapter_tensors,
                  state=self._state, lineage=self._lineage, lineage_examples=self._lineage_examples,
                  profile=self._profile)
        kw.update(changes)
        same_buffers = kw["weights"] is self._weights and kw["device"] == self._device
        copies = [(p.packed_on_device, p.transposed_on_device) for p in (kw["profile"], self._profile)]
        if same_buffers and copies[0] == copies[1]:
            kw["device_copies"] = self._device_copies
        return PretrainedModel(**kw)

    # ---- inspection -------------------------------------------------------------------------
    def config(self) -> LlamaConfig:
        return self._source.config

    def method(self) -> str:
        return "full" if self._method is None else self._method.config.method

    def storage(self) -> str:
        return self._storage

    def device(self) -> str:
        return self._device

    def parameter_names(self) -> list[str]:
        return list(names.expected(self._source.config))

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, _, s in names.expected(self._source.config).values())

    def _trainable_names(self) -> list[str]:
        if self._method is None:
            return self.parameter_names() if self._storage == "float32" else []
        suffixes = self._method.trainable()
        return [n for n in self._adapter_tensors if n.rsplit(".", 1)[-1] in suffixes or n in suffixes]

    def trainable_parameters(self) -> int:
        if self._method is None:
            return self.parameters() if self._storage == "float32" else 0
        return sum(self._adapter_tensors[n].numel() for n in self._trainable_names())

    def updates(self) -> int:
        return self._state.updates if self._state else 0

    def scored_tokens(self) -> int:
        return self._state.scored_tokens if self._state else 0

    def validation_loss(self) -> float:
        if self._state is None or self._state.validation_loss is None:
            raise ConfigError("this model has no validation loss: it has not been trained; "
                              "call fine_tune(...) first")
        return self._state.validation_loss

    def evaluate(self, data) -> float:
        """Token-weighted loss of this model on prepared data (the objective validation uses)."""
        from ..data.supervised import TrainingData
        from ..train.loop import evaluate
        if not isinstance(data, TrainingData):
            raise ConfigError(f"data must come from gen.supervised_csv; got {type(data).__name__}")
        if data.tokenizer_sha256 != self._source.tokenizer_sha256:
            raise ConfigError("data was prepared with another tokenizer; prepare it again with this model")
        return evaluate(self.module(), data, self._device, self._profile)

    def source_sha256(self) -> str:
        return self._source.sha256

    def summary(self) -> str:
        from ..gen import training_backend
        rank = self._method.config.rank if self._method is not None else 0
        return (f"Native pretrained Llama; backend={training_backend()}; device={self._device}; "
                f"parameters={self.parameters()}; trainable={self.trainable_parameters()}; "
                f"method={self.method()}; storage={self._storage}; lora_rank={rank}; "
                f"updates={self.updates()}; scored_tokens={self.scored_tokens()}; "
                f"source_sha256={self._source.sha256}")

    def __repr__(self):
        return f"<PretrainedModel {self.summary()}>"

    def memory_summary(self) -> MemorySummary:
        floating = sum(w.numel() * 4 for w in self._weights.values() if isinstance(w, torch.Tensor))
        packed = sum(w.nbytes() for w in self._weights.values() if not isinstance(w, torch.Tensor))
        trainable_names = set(self._trainable_names())
        adapter = sum(t.numel() * 4 for n, t in self._adapter_tensors.items() if n in trainable_names)
        frozen = sum(t.numel() * 4 for n, t in self._adapter_tensors.items() if n not in trainable_names)
        trainable = adapter if self._method is not None else (floating if self._storage == "float32" else 0)
        optimizer = sum(m.numel() * 4 + v.numel() * 4 for m, v in self._state.moments.values()) \
            if self._state else 0
        paged = self._profile.optimizer == "paged_adamw"
        return MemorySummary(
            weight_bytes=floating + packed, floating_base_bytes=floating, packed_base_bytes=packed,
            adapter_bytes=adapter, frozen_adapter_bytes=frozen, trainable_bytes=trainable,
            optimizer_bytes=optimizer, dequant_tile_bytes=self._dequant_tile_bytes(),
            estimated_budget_bytes=self._budget, compute_dtype=self._profile.precision, storage=self._storage,
            paged_optimizer=paged, paged_optimizer_bytes=optimizer if paged else 0,
            optimizer_window_bytes=2 * 2 * self._profile.page_bytes if paged else 0,   # two (m, v) page pairs
            gpu_packed_base_bytes=sum(c.nbytes() for c in self._device_copies.values()))

    def _dequant_tile_bytes(self) -> int:
        """The decoded weight alive at once: host tiles of 4 MiB, none inside the fused kernels'
        tiles, the largest matrix in the operand dtype for the decoded products, or with
        decoded_kept every matrix that is multiplied whole (all but an untied embedding, which is
        only looked up): the forward keeps each for its backward, and the head is decoded last.
        An adapted matrix counts its room to spare (`_spare`)."""
        kernel = self._profile.nf4_kernel
        if self._storage == "float32" or kernel == "fused":
            return 0
        if kernel == "host_tiled":
            return 4 << 20
        itemsize = self._profile.compute_dtype.itemsize
        looked_up = "token_embd.weight" if "output.weight" in self._weights else None
        spare = self._spare()
        sizes = [(w.shape[0] * w.shape[1] + spare.get(n, 0) * max(w.shape)) * itemsize for n, w in self._weights.items()
                 if not isinstance(w, torch.Tensor) and n != looked_up]
        return sum(sizes) if kernel == "decoded_kept" else max(sizes)

    def _spare(self) -> dict:
        """target -> the columns or rows to count beside its decode or cast, along its longer side:
        3 r where the fused adapter kernels may join its delta to its product or du @ A to its
        input gradient (`kernels.joins_deltas`; every target, whatever its shape), and a layer's gate
        and up 6 r where its down is adapted too (their weights paired for the SwiGLU inside the
        GEMM, `kernels.lora.gated_mlp`)."""
        method = self._method.config if self._method is not None else None
        if method is None or self._profile.adapter_kernel != "fused" \
                or not joins_deltas(self._profile.compute_dtype, [method.rank]):
            return {}
        return {t: 3 * method.rank * (1 + _paired(t, method.targets)) for t in method.targets}

    # ---- placement and profile --------------------------------------------------------------
    def to(self, device) -> "PretrainedModel":
        """The same untrained model on `device` (the source stays usable where it is)."""
        if self._state is not None:
            raise ConfigError(f"moving a trained model is refused: a trained model resumes on its recorded "
                              f"device {self._device!r}; move the untrained selection instead")
        device = check_device(device)
        self._profile.check_placement(device, self._storage)
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731 packed stays on host
        return self._derive(device=device, weights={n: move(w) for n, w in self._weights.items()},
                            adapter_tensors={n: t.to(device) for n, t in self._adapter_tensors.items()})

    def with_training_profile(self, precision="float32", optimizer="adamw", nf4_kernel="host_tiled",
                              page_bytes=2097152, cuda_graphs=False, adapter_kernel="torch",
                              layer_kernel="torch", attention_kernel=None) -> "PretrainedModel":
        """Select the numerical profile of training; only an untrained model can change it."""
        if self._state is not None:
            raise ConfigError("changing the training profile of a trained model is refused: exact resume "
                              f"keeps the recorded profile {self._profile.as_dict()}")
        profile = Profile(precision, optimizer, nf4_kernel, page_bytes, cuda_graphs, adapter_kernel, layer_kernel,
                          attention_kernel)
        profile.check_placement(self._device, self._storage)
        return self._derive(profile=profile)

    def training_profile(self) -> dict:
        scale = self._state.loss_scale if self._state else None
        return {**self._profile.as_dict(), "master_dtype": "float32",
                "loss_scale": scale.as_dict() if scale and self._profile.precision == "float16" else None}

    # ---- running the model ------------------------------------------------------------------
    def module(self):
        """The torch Llama of this handle (built once, cached; its tensors must not be changed)."""
        if self._module is None:
            self._module = build(self._source.config, self._weights, self._method, self._adapter_tensors,
                                 self._device_copies, nf4_kernel=self._profile.nf4_kernel)
        return self._module

    @torch.no_grad()
    def logits(self, tokens) -> np.ndarray:
        """FP32 logits of every position of one token sequence: (len(tokens), vocabulary)."""
        tokens = list(tokens)
        c = self._source.config
        if not tokens or len(tokens) > c.context_length:
            raise ConfigError(f"tokens has {len(tokens)} entries; accepted: 1..{c.context_length}")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < c.vocab_size for t in tokens):
            raise ConfigError(f"tokens must be integers in 0..{c.vocab_size - 1}")
        x = torch.tensor([tokens], dtype=torch.long, device=self._device)
        return self.module()(x)[0].cpu().numpy()

    # ---- selections -------------------------------------------------------------------------
    def _require_unchanged(self, what: str) -> None:
        if self._method is not None:
            raise ConfigError(f"{what} is refused: this model already has a {self.method()} adapter "
                              "(adapters are not silently reconfigured); select it on the imported base")
        if self._state is not None:
            raise ConfigError(f"{what} is refused: this model's full weights were trained; save it with "
                              "save_model(...) and import that file as a new base first")

    def _select(self, method_cls, config) -> "PretrainedModel":
        method = method_cls(config)
        tensors = {k: v.to(self._device) for k, v in method.init(self._dense_targets(config.targets)).items()}
        return self._derive(method=method, adapter_tensors=tensors, state=None)

    def _dense_targets(self, targets):
        """target -> FP32 CPU matrix; a packed target is decoded when read, one at a time."""
        from ..quant.storage import DecodedTargets
        return DecodedTargets({t: w for t, w in self._weights.items() if t in targets})

    def _shapes(self) -> dict:
        return {n: tuple(s) for n, (_, _, s) in names.expected(self._source.config).items()}

    def nf4(self, double_quant=True) -> "PretrainedModel":
        """This unchanged floating base with every matrix packed to NF4 (norm vectors stay FP32),
        frozen: train it through an adapter. The original handle keeps its own FP32 weights."""
        from ..quant.storage import (PACK_WORKSPACE_BYTES, check_double_quant, pack_weights, stored_nbytes,
                                     storage_name)
        self._require_unchanged("nf4 conversion")
        double_quant = check_double_quant(double_quant)
        if self._storage != "float32":
            raise ConfigError(f"nf4 conversion is refused: this base is already {self._storage}; "
                              "convert the floating base it came from")
        self._profile.check_placement(self._device, storage_name(double_quant))
        shapes = self._shapes().values()
        owned = self.memory_summary().weight_bytes + sum(stored_nbytes(s, double_quant) for s in shapes)
        admit("nf4 conversion (packed weights beside this model's FP32 weights, plus packing workspace)",
              owned + PACK_WORKSPACE_BYTES, self._budget)
        return self._derive(weights=pack_weights(self._weights, double_quant), storage=storage_name(double_quant))

    def qlora(self, targets=None, rank=8, alpha=16.0, seed=0) -> "PretrainedModel":
        """QLoRA: LoRA on a frozen NF4 base. A floating base is packed first with double quantization;
        an already packed base keeps its scale format (nf4 or nf4_double_quant)."""
        from ..adapters import registry
        self._require_unchanged("qlora selection")
        registry.config("lora", targets, rank, alpha, seed, self._source.config, self._shapes())  # fail before packing
        base = self if self._storage != "float32" else self.nf4(double_quant=True)
        return base.lora(targets, rank, alpha, seed)

    def lora(self, targets=None, rank=8, alpha=16.0, seed=0) -> "PretrainedModel":
        return self._adapter("lora", targets, rank, alpha, seed)

    def rs_lora(self, targets=None, rank=8, alpha=16.0, seed=0) -> "PretrainedModel":
        return self._adapter("rslora", targets, rank, alpha, seed)

    def lora_fa(self, targets=None, rank=8, alpha=16.0, seed=0) -> "PretrainedModel":
        """LoRA with A frozen at its seeded initialisation and B's gradient preconditioned."""
        return self._adapter("lora_fa", targets, rank, alpha, seed)

    def tinylora(self, targets=None, rank=8, parameters=13, seed=0, sharing="global") -> "PretrainedModel":
        """TinyLoRA: `parameters` trainable numbers (one vector for all targets, or one per target)
        steering each target's frozen top-`rank` singular directions; no alpha (scale 1)."""
        from ..adapters import registry, tinylora
        self._require_unchanged("tinylora selection")
        config = registry.config("tinylora", targets, rank, 1.0, seed, self._source.config, self._shapes(),
                                 parameters=parameters, sharing=sharing)
        admit("tinylora selection (frozen SVD factors and projections plus one float64 SVD workspace)",
              tinylora.selection_bytes(config, self._shapes()), self._budget)
        return self._select(registry.METHODS["tinylora"], config)

    def _adapter(self, kind, targets, rank, alpha, seed, **extra) -> "PretrainedModel":
        from ..adapters import registry
        self._require_unchanged(f"{kind} selection")
        config = registry.config(kind, targets, rank, alpha, seed, self._source.config, self._shapes(), **extra)
        return self._select(registry.METHODS[kind], config)

    # ---- training ---------------------------------------------------------------------------
    def _check_data(self, training, validation):
        from ..data.supervised import TrainingData
        for data, role in ((training, "training"), (validation, "validation")):
            if not isinstance(data, TrainingData):
                raise ConfigError(f"{role} data must come from gen.supervised_csv; got {type(data).__name__}")
            if data.role() != role:
                raise ConfigError(f"{role} data has role={data.role()!r}; accepted: role={role!r}")
            if data.tokenizer_sha256 != self._source.tokenizer_sha256:
                raise ConfigError(f"{role} data was prepared with tokenizer {data.tokenizer_sha256[:12]}…; this "
                                  f"model's tokenizer is {self._source.tokenizer_sha256[:12]}…; prepare it again "
                                  "with this model")
        seen = training.example_hashes() | self._lineage_examples
        overlap = [i + 1 for i, e in enumerate(validation.items) if e.sha256() in seen]
        if overlap:
            raise ConfigError(f"validation example(s) {overlap[:10]} also appear exactly in this run's "
                              "training data or the model's training lineage; choose disjoint rows")

    def _kept_bytes(self, micro_batch: int, context: int) -> int:
        """What backward keeps over one micro-batch: the activations (and the loss's transient
        chunk), the adapters' products' own, and under FP16/BF16 the operand-dtype copies of
        floating matrices that their products save, with their room to spare (`_spare`)."""
        p, c = self._profile, self._source.config
        itemsize = p.compute_dtype.itemsize
        spare = self._spare()
        casts = 0 if itemsize == 4 else sum((w.numel() + spare.get(n, 0) * max(w.shape)) * itemsize
                                            for n, w in self._weights.items()
                                            if isinstance(w, torch.Tensor) and w.dim() == 2)
        adapters = 0
        if self._method is not None:
            cfg, shapes = self._method.config, self._shapes()
            adapters = adapter_activation_bytes(cfg.method, [(*shapes[t], cfg.rank) for t in cfg.targets],
                                                micro_batch * context, itemsize, p.adapter_kernel == "fused")
        return casts + adapters + activation_bytes(c, micro_batch, context, self._device, itemsize,
                                                   p.layer_kernel == "fused", self._method is None,
                                                   self._fused_attention())

    def _fused_attention(self) -> bool:
        """Whether attention runs through our kernel or cuDNN's under this profile (not torch's)."""
        kernel = self._profile.attention_kernel or self._profile.layer_kernel
        if kernel == "torch":
            return False
        if kernel == "fused":
            from ..kernels.attention import supported
        else:
            from ..kernels.cudnn_attention import supported
        c = self._source.config
        return supported(torch.empty(0, 0, 0, c.head_dim, dtype=self._profile.compute_dtype, device="meta"))

    def _training_bytes(self, micro_batch: int, context: int) -> int:
        """The estimate that training is admitted by: tensors, two gradient sets (a micro-batch's
        and the window's sum, or a CUDA graph's shared buffers), the two moments, what backward keeps."""
        m = self.memory_summary()
        needed = m.weight_bytes + m.adapter_bytes + m.frozen_adapter_bytes + 4 * m.trainable_bytes \
            + self._kept_bytes(micro_batch, context) + m.dequant_tile_bytes + m.gpu_packed_base_bytes
        if self._method is None and self._storage == "float32":
            needed += m.floating_base_bytes  # the private copy that training updates
        return needed

    def fine_tune(self, training, validation, steps, micro_batch=1, accumulation=1, rate=2e-4, seed=0,
                  clip_norm=1.0, progress=None) -> "PretrainedModel":
        """Start a new optimizer run of `steps` updates; return the trained model (self unchanged)."""
        state, steps = self._fine_tune_start(training, validation, steps, micro_batch, accumulation, rate,
                                             seed, clip_norm)
        return self._train(training, validation, state, steps, progress)

    def resume(self, training, validation, steps, progress=None) -> "PretrainedModel":
        """Continue the saved optimizer run exactly; the data must be the run's data."""
        state, steps = self._resume_start(training, validation, steps)
        return self._train(training, validation, state, steps, progress)

    def fine_tune_plan(self, training, validation, steps, micro_batch=1, accumulation=1, rate=2e-4, seed=0,
                       clip_norm=1.0):
        """fine_tune(...) prepared, not run: a validated, immutable `aner.jobs.PretrainedPlan`."""
        from ..jobs import PretrainedPlan
        state, steps = self._fine_tune_start(training, validation, steps, micro_batch, accumulation, rate,
                                             seed, clip_norm)
        return PretrainedPlan(self, "fine_tune", training, validation, state, steps)

    def resume_plan(self, training, validation, steps):
        """resume(...) prepared, not run: a validated, immutable `aner.jobs.PretrainedPlan`."""
        from ..jobs import PretrainedPlan
        state, steps = self._resume_start(training, validation, steps)
        return PretrainedPlan(self, "resume", training, validation, state, steps)

    def _fine_tune_start(self, training, validation, steps, micro_batch, accumulation, rate, seed, clip_norm):
        """The checks of fine_tune and fine_tune_plan: (initial TrainState, steps). Admission is in _train."""
        from ..train.loop import RunConfig, TrainState, check_steps
        steps = check_steps(steps)
        run = RunConfig(micro_batch, accumulation, rate, seed, clip_norm)
        if self._method is None and self._storage != "float32":
            raise ConfigError(f"full fine-tuning of a {self._storage} base is refused: a packed base is "
                              "frozen; select an adapter first (lora, rs_lora, lora_fa, tinylora)")
        self._check_data(training, validation)
        return TrainState(run, training.sha256(), validation.sha256()), steps

    def _resume_start(self, training, validation, steps):
        """The checks of resume and resume_plan: (saved TrainState, steps). Admission is in _train."""
        from ..train.loop import check_steps
        steps = check_steps(steps)
        if self._state is None:
            raise ConfigError("resume needs a trained model or a loaded checkpoint; use fine_tune to start")
        self._check_data(training, validation)
        if training.sha256() != self._state.training_sha256 or validation.sha256() != self._state.validation_sha256:
            raise ConfigError("resume needs the run's exact data: training sha256 "
                              f"{self._state.training_sha256[:12]}…, validation "
                              f"{self._state.validation_sha256[:12]}…; got other data (changing data starts a "
                              "new fine_tune run)")
        return self._state, steps

    def _train(self, training, validation, state, steps, progress, on_update=None) -> "PretrainedModel":
        """Admit, then train private copies of the trainable tensors; return the trained handle.

        `on_update(state, view)` runs after every committed update (returning False stops there);
        `view()` is the model at that boundary. It shares the live tensors rather than cloning them
        (no second copy outside the memory admission), so it is valid only until the callback
        returns: use it synchronously (jobs publish checkpoints from it), never keep it. Its
        validation loss is None: no evaluation of those weights has run.
        """
        from ..train.loop import run
        context = max(len(e.tokens) for e in training.items)
        admit("training", self._training_bytes(state.run.micro_batch, context), self._budget)
        weights, tensors = self._weights, self._adapter_tensors
        if self._method is None:
            weights = {n: w.detach().clone().requires_grad_(True) for n, w in weights.items()}
            trainable = weights
        else:
            tensors = {n: t.detach().clone() for n, t in tensors.items()}
            trainable = {n: tensors[n].requires_grad_(True) for n in self._trainable_names()}
        state = replace(state, moments={n: (m.clone(), v.clone()) for n, (m, v) in state.moments.items()})
        model = build(self._source.config, weights, self._method, tensors, self._device_copies,
                      self._profile.adapter_kernel, self._profile.layer_kernel, self._profile.nf4_kernel,
                      self._profile.attention_kernel)

        def trained(state):
            frozen = {n: w.detach() for n, w in weights.items()} if self._method is None else weights
            lineage = self._lineage if training.sha256() in self._lineage else self._lineage + (training.sha256(),)
            return self._derive(weights=frozen, adapter_tensors={n: t.detach() for n, t in tensors.items()},
                                state=state, lineage=lineage,
                                lineage_examples=self._lineage_examples | training.example_hashes())

        def boundary(s):
            return on_update(s, lambda: trained(replace(s, validation_loss=None)))

        state = run(model, tensors, trainable, self._method, training, validation, state, steps,
                    self._device, progress, boundary if on_update else None, self._profile)
        return trained(state)

    # ---- artifacts --------------------------------------------------------------------------
    def checkpoint(self, path) -> str:
        from ..formats.checkpoint import write_checkpoint
        return write_checkpoint(self, path)

    def save_model(self, path) -> str:
        from ..formats.export import save_merged
        return save_merged(self, path)

    def save_adapter(self, directory):
        from ..formats.export import save_adapter
        return save_adapter(self, directory)

    def save_peft_adapter(self, directory) -> str:
        """The adapter as a PEFT LoRA directory (adapter_model.safetensors, adapter_config.json)."""
        from ..formats.peft import save_peft_adapter
        return save_peft_adapter(self, directory)

    def iter_merged_weights(self, merge=True):
        """(name, FP32 CPU tensor) in canonical order, decoding/merging one matrix per step, so a
        streamed export of a packed base holds one dense matrix at a time. merge=False: the base alone."""
        adapter = {k: v.detach().cpu() for k, v in self._adapter_tensors.items()}
        for name in self.parameter_names():
            w = self._weights[name]
            w = (w if isinstance(w, torch.Tensor) else w.dequantize()).detach().cpu()
            if merge and self._method is not None and name in self._method.config.targets:
                w = w + self._method.delta(name, adapter)
            yield name, w
