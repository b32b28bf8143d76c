"""TinyLoRA (`paper_usigma_v1`): a few trainable numbers steering the frozen top singular directions.

For each target W (out, in) with truncated SVD W ~ U_r diag(S_r) V_r^T:

    delta W = U_r diag(S_r) R V_r^T,   R = sum_i v_i P_i   (r x r)

U_r (out, r), S_r (r,) and V_r^T (r, in) are the exact truncated SVD of the frozen base matrix
(torch.linalg.svd in float64 of the FP32 weight, then rounded once to FP32) and never change.
P (u, r, r) per target has independent N(0, 1/r) entries from the seed, salted by the target's
name so a target's projections do not depend on which other targets were chosen. v (u,) starts at
zero, so a fresh adapter is exactly the base. The scale is 1 (no alpha).

sharing="global": one vector `tinylora.v` feeds every target (u trainable numbers in all);
sharing="per_target": each target has its own `<target>.tinylora_v`.

Tensors per target: `.tinylora_u` (out, r), `.tinylora_s` (r,), `.tinylora_vt` (r, in),
`.tinylora_p` (u, r, r); all FP32, all saved in checkpoints.
"""
import hashlib

import torch
from torch import nn

from .base import Method, add_low_rank, full_precision, seeded

GLOBAL_V = "tinylora.v"
MAX_PARAMETERS = 4096
SHARING = ("global", "per_target")
_SALT = 0x7171   # keeps TinyLoRA's streams apart from LoRA's (seed, index) streams


def target_salt(target: str) -> int:
    return int.from_bytes(hashlib.sha256(target.encode()).digest()[:8], "little") >> 1


def truncated_svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U_r (out, r), S_r (r,), V_r^T (r, in)): float64 SVD of the FP32 matrix, rounded to FP32."""
    u, s, vt = torch.linalg.svd(w.detach().cpu().double(), full_matrices=False)
    return u[:, :rank].float().contiguous(), s[:rank].float().contiguous(), vt[:rank].float().contiguous()


def selection_bytes(config, shapes: dict) -> int:
    """Bytes a TinyLoRA selection owns (FP32 U, S, V^T, P, v) plus the float64 SVD workspace of its
    largest target (the matrix, U, S and V^T at once)."""
    r, u = config.rank, config.parameters
    owned = sum(4 * (rows * r + r + r * cols + u * r * r) for rows, cols in (shapes[t] for t in config.targets))
    owned += 4 * u * (1 if config.sharing == "global" else len(config.targets))
    workspace = max(8 * (2 * rows * cols + min(rows, cols) * (rows + cols + 1))
                    for rows, cols in (shapes[t] for t in config.targets))
    return owned + workspace


class TinyLoRALinear(nn.Module):
    """base(x) + ((x @ V_r) @ (diag(S) R)^T) @ U_r^T: never a dense (out, in) delta.

    The adapter part runs in the adapter tensors' dtype (FP32 in models, float64 in gradient checks).
    """

    def __init__(self, base: nn.Module, u, s, vt, p, v, fused: bool = False):
        super().__init__()
        self.base = base
        self.u, self.s, self.vt, self.p, self.v = u, s, vt, p, v
        self.fused = fused

    def forward(self, x):
        with full_precision(x):
            r = torch.einsum("i,ijk->jk", self.v, self.p)        # (r, r) = sum_i v_i P_i
            m = self.s[:, None] * r                               # (r, r) = diag(S) R
            b = self.u @ m if self.fused else None                # (out, r) = U diag(S) R
        if self.fused:
            # A = V^T and B in one low-rank product, the base's inside (it runs under the policy).
            return add_low_rank(self.base, x, self.vt, b, True)
        y = self.base(x)
        with full_precision(x):
            h = x.to(self.vt.dtype) @ self.vt.t()                 # (..., r)
            delta = (h @ m.t()) @ self.u.t()                      # (..., r) then (..., out)
        return y + delta.to(y.dtype)


class TinyLoRA(Method):
    def __init__(self, config):
        assert config.sharing in SHARING and 1 <= config.parameters <= MAX_PARAMETERS, config
        self.config = config

    def _v_name(self, target: str) -> str:
        return GLOBAL_V if self.config.sharing == "global" else f"{target}.tinylora_v"

    def init(self, weights):
        r, n = self.config.rank, self.config.parameters
        out = {}
        for target in self.config.targets:
            u, s, vt = truncated_svd(weights[target], r)
            g = seeded(self.config.seed, _SALT, target_salt(target))
            p = torch.randn(n, r, r, dtype=torch.float32, generator=g).mul_(r ** -0.5)
            out.update({f"{target}.tinylora_u": u, f"{target}.tinylora_s": s,
                        f"{target}.tinylora_vt": vt, f"{target}.tinylora_p": p})
            out[self._v_name(target)] = torch.zeros(n, dtype=torch.float32)
        return out

    def trainable(self):
        return (GLOBAL_V,) if self.config.sharing == "global" else ("tinylora_v",)

    def wrap(self, target, base, tensors, fused=False):
        t = target
        return TinyLoRALinear(base, tensors[f"{t}.tinylora_u"], tensors[f"{t}.tinylora_s"],
                              tensors[f"{t}.tinylora_vt"], tensors[f"{t}.tinylora_p"], tensors[self._v_name(t)],
                              fused)

    def lora_factors(self, target, tensors):
        """A = V_r^T (r, in), B = U_r diag(S_r) R (out, r); B is formed in float64, rounded once."""
        t = target
        v, p = tensors[self._v_name(t)].double(), tensors[f"{t}.tinylora_p"].double()
        r = torch.einsum("i,ijk->jk", v, p)
        b = (tensors[f"{t}.tinylora_u"].double() * tensors[f"{t}.tinylora_s"].double()) @ r
        return tensors[f"{t}.tinylora_vt"], b.float()
