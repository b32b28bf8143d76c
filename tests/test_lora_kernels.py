"""Fused low-rank adapter kernels (aner.kernels.lora) against float64 references.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) with small
shapes; skips otherwise (`make test` runs it under the interpreter). Tolerances are relative to
the sum of absolute products (FP32 sums: 1e-5), plus the output's own rounding for FP16/BF16
outputs.
"""
import dataclasses

import pytest
import torch

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.kernels import lora as L  # noqa: E402
from aner.kernels.splits import sum_splits  # noqa: E402
from aner.model.llama import Dense  # noqa: E402

if INTERPRET:
    # The interpreter's BF16 tl.dot is wrong (numpy has no BF16): check the FP32 FMA products there;
    # the tensor-core products are checked on the GPU.
    _tiles = L.default_tiles
    L.default_tiles = lambda *a: dataclasses.replace(_tiles(*a), tc=False)
EPS = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
# (tokens, in, out, rank): partial tiles everywhere, rank 1 and ranks past one rank tile.
CASES = [(37, 100, 50, 8), (5, 64, 70, 1), (130, 192, 96, 16), (64, 48, 33, 40)]
if not INTERPRET:
    CASES += [(4096, 2048, 512, 16), (1000, 576, 1536, 64), (3000, 1536, 576, 256)]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


def close(got, ref, scale, dtype, more=0.0):
    """|got - ref| <= 1e-5 * scale (FP32 sums) + the rounding of got to `dtype` (+ `more`)."""
    err = (got.double() - ref).abs()
    assert (err <= 1e-5 * scale + EPS[dtype] * ref.abs() + more + 1e-30).all(), err.max().item()


def frozen_base(n_in, n_out):
    return Dense(torch.randn(n_out, n_in, device=DEV) / n_in ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_and_gradients(case, dtype):
    """Around a frozen base: the delta rounded to x's dtype, then the base's GEMM adds its product
    to it, within a rounding of each (cuBLAS may round its product before the add:
    `benchmarks/delta_rounding.py`); the same for du @ A and the base's input gradient."""
    M, n_in, n_out, r = case
    base = frozen_base(n_in, n_out)
    x = torch.randn(M, n_in, device=DEV).to(dtype)
    a, b = torch.randn(r, n_in, device=DEV) / n_in ** 0.5, torch.randn(n_out, r, device=DEV)
    g = torch.randn(M, n_out, device=DEV).to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, a, b)]
    out = L.adapted_projection(base, *leaves)
    out.backward(g)
    assert out.dtype == dtype and [t.grad.dtype for t in leaves] == [dtype, torch.float32, torch.float32]
    xd, ad, bd, gd = (t.double() for t in (x, a, b, g))
    wd = base.weight.to(dtype).double()                      # the base's operand
    u, du = xd @ ad.t(), gd @ bd
    au, adu = xd.abs() @ ad.abs().t(), gd.abs() @ bd.abs()
    delta, ddx = u @ bd.t(), du @ ad
    close(out, xd @ wd.t() + delta, xd.abs() @ wd.abs().t() + au @ bd.abs().t(), dtype, EPS[dtype] * delta.abs())
    close(leaves[0].grad, gd @ wd + ddx, gd.abs() @ wd.abs() + adu @ ad.abs(), dtype, EPS[dtype] * ddx.abs())
    close(leaves[1].grad, du.t() @ xd, adu.t() @ xd.abs(), torch.float32)
    close(leaves[2].grad, gd.t() @ u, gd.abs().t() @ au, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_projections_of_one_input_together(dtype):
    """Projections that read one x (q, k, v): one project over the stacked A's, one expand writing
    the stacked du @ A, one reduce for every A's gradient; each output and gradient as each
    adapter's own, to FP32 accuracy. The bases' input gradients are one chain of products onto
    du @ A in x's dtype: one rounding of the running sum per base."""
    M, n_in = (300, 192) if not INTERPRET else (37, 100)
    shapes = [(96, 16), (24, 16), (50, 3)]                    # (out, rank): unequal ranks and outputs
    bases = [frozen_base(n_in, n) for n, _ in shapes]
    x = torch.randn(M, n_in, device=DEV).to(dtype).requires_grad_(True)
    a_s = [(torch.randn(r, n_in, device=DEV) / n_in ** 0.5).requires_grad_(True) for _, r in shapes]
    b_s = [torch.randn(n, r, device=DEV).requires_grad_(True) for n, r in shapes]
    g_s = [torch.randn(M, n, device=DEV).to(dtype) for n, _ in shapes]
    outs = L.adapted_projections(bases, x, a_s, b_s)
    torch.autograd.backward(outs, g_s)
    check_group(x, a_s, b_s, g_s, [base.weight.to(dtype).double() for base in bases], outs, dtype,
                lambda out, ref, delta, scale, _: close(out, ref, scale, dtype, EPS[dtype] * delta.abs()))


def check_group(x, a_s, b_s, g_s, ws, outs, dtype, check_out):
    """Projections of one x against float64, for the bases' operands ws: each output by
    check_out(out, reference, delta, |x| @ |W|^T + |u| @ |B|^T, |u| @ |B|^T), each factor's
    gradient, and x's: du @ A rounded, then one rounding of the running sum per base."""
    xd = x.detach().double()
    dxd = sum(g.double() @ w for g, w in zip(g_s, ws))
    dx_scale = sum(g.double().abs() @ w.abs() for g, w in zip(g_s, ws))
    ddx, ddx_scale = 0, 0
    for a, b, g, w, out in zip(a_s, b_s, g_s, ws, outs):
        ad, bd, gd = (t.detach().double() for t in (a, b, g))
        u, du = xd @ ad.t(), gd @ bd
        au, adu = xd.abs() @ ad.abs().t(), gd.abs() @ bd.abs()
        delta, ub = u @ bd.t(), au @ bd.abs().t()
        check_out(out, xd @ w.t() + delta, delta, xd.abs() @ w.abs().t() + ub, ub)
        close(a.grad, du.t() @ xd, adu.t() @ xd.abs(), torch.float32)
        close(b.grad, gd.t() @ u, gd.abs().t() @ au, torch.float32)
        ddx, ddx_scale = ddx + du @ ad, ddx_scale + adu @ ad.abs()
    n = len(outs)
    close(x.grad, dxd + ddx, dx_scale + ddx_scale, dtype, EPS[dtype] * ((n + 1) * ddx.abs() + n * dx_scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stacked_bases_make_one_product(dtype):
    """Bases of one x whose operands can lie one under another in one matrix (NF4 decodes kept,
    decoded into one buffer; dense casts, as `train.loop.kept_casts` lays a group's out or made and
    concatenated): the outputs are one product's columns, side by side, and with their gradients
    side by side the input gradient is one product over all the rows (with them apart, a chain).
    Every output and gradient as each adapter's own, to FP32 accuracy; the NF4 bases' bits those of
    dense casts of their decodes. Not for one base, decodes made again in backward, or dense
    weights multiplied as they are (FP32)."""
    from aner.kernels.nf4 import DevicePacked
    from aner.model.llama import side_by_side
    from aner.quant.module import NF4Module
    from aner.quant.nf4 import NF4Weight
    M, n_in = (300, 192) if not INTERPRET else (37, 64)
    shapes = [(96, 16), (32, 16), (40, 8)]                       # (out, rank): q, k and v's kind
    rows = [n for n, _ in shapes]
    weights = [NF4Weight.quantize(torch.randn(n, n_in) * 0.05) for n in rows]
    nf4 = [NF4Module(w, device_copy=DevicePacked.from_weight(w, DEV), decoded=True, kept=True) for w in weights]
    decodes = torch.cat([base.operand(dtype) for base in nf4])
    dense = [Dense(part.float()) for part in decodes.split(rows)]
    x0 = torch.randn(M, n_in, device=DEV).to(dtype)
    assert L._stacked(nf4[:1], x0, dtype) is None
    assert L._stacked([NF4Module(w, device_copy=base.device_copy, decoded=True) for w, base in zip(weights, nf4)],
                      x0, dtype) is None
    if dtype == torch.float32:
        assert L._stacked(dense, x0, dtype) is None
    else:
        assert torch.equal(L._stacked(dense, x0, dtype), decodes)              # casts made and concatenated
        for m, part in zip(dense, decodes.clone().split(rows)):
            m.cast = part                                         # laid one under another
        assert L._stacked(dense[1:], x0, dtype).data_ptr() == dense[1].cast.data_ptr()
    a0 = [torch.randn(r, n_in, device=DEV) / n_in ** 0.5 for _, r in shapes]
    b0 = [torch.randn(n, r, device=DEV) * 0.1 for n, r in shapes]
    side = list(torch.randn(M, sum(rows), device=DEV).to(dtype).split(rows, 1))   # as the fused RoPE hands them back

    def run(bases, g_s):
        x, *leaves = (t.clone().requires_grad_(True) for t in (x0, *a0, *b0))
        outs = L.adapted_projections(bases, x, leaves[:3], leaves[3:])
        assert side_by_side(outs, 1) is not None
        torch.autograd.backward(outs, g_s)
        return [o.detach() for o in outs] + [t.grad for t in (x, *leaves)], (x, leaves, outs, g_s)
    runs = [run(nf4, side), run(nf4, [g.contiguous() for g in side])]
    if dtype != torch.float32:
        assert all(torch.equal(p, q) for p, q in zip(runs[0][0], run(dense, side)[0]))
    ws = [base.operand(dtype).double() for base in nf4]
    for _, (x, leaves, outs, g_s) in runs:
        check_group(x, leaves[:3], leaves[3:], g_s, ws, outs, dtype,
                    lambda out, ref, delta, scale, _: close(out, ref, scale, dtype, EPS[dtype] * delta.abs()))


def test_deterministic_with_a_frozen_factor():
    """Two runs give the same bits, forward and gradients, with A frozen as in LoRA-FA; an input
    that needs no gradient (the first layer's) changes nothing else."""
    M, n_in, n_out, r = (4096, 256, 128, 16) if not INTERPRET else (70, 64, 32, 4)
    base = frozen_base(n_in, n_out)
    x = torch.randn(M, n_in, device=DEV, requires_grad=True)
    a = torch.randn(r, n_in, device=DEV)                      # frozen, as in LoRA-FA
    b = torch.randn(n_out, r, device=DEV, requires_grad=True)
    g = torch.randn(M, n_out, device=DEV)

    def run(x):
        out = L.adapted_projection(base, x, a, b)
        return [out.detach().clone(), *torch.autograd.grad(out, [x, b] if x.requires_grad else [b], g)]
    first, second = run(x), run(x)
    assert all(torch.equal(p, q) for p, q in zip(first, second))
    out, db = run(x.detach())
    assert torch.equal(out, first[0]) and torch.equal(db, first[2])


VARIANTS = [L.Tiles(16, 32, split=3, tc=False), L.Tiles(32, 16, warps=2, split=1, tc=False)]
if not INTERPRET:
    VARIANTS += [L.Tiles(16, 32, split=3), L.Tiles(64, 128, warps=8, split=1)]


@pytest.mark.parametrize("tiles", VARIANTS, ids=str)
def test_tile_variants(tiles):
    """Options the benchmark may pick: split reductions, FMA and tensor-core products."""
    M, n_in, r = 70, 100, 5
    p, w = torch.randn(M, n_in, device=DEV), torch.randn(r, n_in, device=DEV)
    q = torch.randn(M, r, device=DEV)
    ref, scale = p.double() @ w.double().t(), p.double().abs() @ w.double().abs().t()
    close(L.project(p, w, tiles), ref, scale, torch.float32)
    close(L.expand(L.to_parts(q), w.t(), p, torch.float32, tiles), p.double() + q.double() @ w.double(),
          p.double().abs() + q.double().abs() @ w.double().abs(), torch.float32)
    close(L.reduce_tokens(p, L.to_parts(q), tiles), p.double().t() @ q.double(),
          p.double().abs().t() @ q.double().abs(), torch.float32)


def test_products_through_parts():
    """project writes its output as BF16 parts, into columns of wider planes: hi + mid + lo, summed
    in that order, is the FP32 output exactly (the one project returns without planes), and they
    are the parts `to_parts` makes of it. expand and reduce_tokens read parts at any row stride:
    the same bits as from a contiguous copy, and the products to FP32 accuracy."""
    M, n_in = (3000, 576) if not INTERPRET else (70, 100)
    p = torch.randn(M, n_in, device=DEV)
    planes = torch.full((3, M, 24), float("nan"), device=DEV, dtype=torch.bfloat16)
    for r, cols in ((16, slice(0, 16)), (5, slice(19, 24))):
        w = torch.randn(r, n_in, device=DEV) / n_in ** 0.5
        L.project(p, w, parts=planes[:, :, cols])
        q, parts = L.project(p, w), planes[:, :, cols]
        assert torch.equal(parts, L.to_parts(q))
        hi, mid, lo = parts.float()
        assert torch.equal((hi + mid) + lo, q)
        g = torch.randn(M, 40, device=DEV).bfloat16()
        b = torch.randn(40, r, device=DEV)
        db, delta = L.reduce_tokens(g, parts), L.expand(parts, b, None, torch.float32)
        assert torch.equal(db, L.reduce_tokens(g, parts.contiguous()))
        dbt = L.reduce_tokens(g, parts, transposed=True)
        assert dbt.is_contiguous() and torch.equal(dbt, db.t())
        assert torch.equal(L.reduce_tokens(g, parts, scale=2 / 3), db * (2 / 3))     # torch's product's bits
        assert torch.equal(delta, L.expand(parts.contiguous(), b, None, torch.float32))
        qd = q.double()
        close(db, g.double().t() @ qd, g.double().abs().t() @ qd.abs(), torch.float32)
        close(delta, qd @ b.double().t(), qd.abs() @ b.double().abs().t(), torch.float32)
    assert planes[:, :, 16:19].float().isnan().all()                      # the columns between untouched


@pytest.mark.parametrize("split", [1, 3])
def test_parts_written_by_project(split):
    """In one part, project writes u's BF16 parts itself (no ordered sum to make), into columns of
    wider planes and into the joined operand x' beside its copy of x: the bits the ordered sum
    writes from project's FP32 output, as it does at three parts; nothing else written."""
    M, K, ranks = (300, 576, (8, 16)) if not INTERPRET else (37, 300, (8, 16))
    r, tiles = sum(ranks), L.Tiles(32, 64, split=split, tc=not INTERPRET)
    p = torch.randn(M, K, device=DEV).bfloat16()
    w = torch.randn(r, K, device=DEV) / K ** 0.5
    assert L._parts(-(-M // 32), -(-K // 64), split)[0] == split
    runs, unwritten = [], 2.0 ** 100
    for by_project in (True, False):
        wide = torch.full((M, 3 * r + K), unwritten, device=DEV, dtype=torch.bfloat16)
        planes = torch.full((3, M, r + 5), unwritten, device=DEV, dtype=torch.bfloat16)
        if by_project:
            L.project(p, w, tiles, parts=planes[:, :, 2:2 + r], joined=(wide, ranks[0]))
        else:
            wide[:, 3 * ranks[0]:3 * ranks[0] + K] = p
            sum_splits(L.project(p, w, tiles)[None], parts=planes[:, :, 2:2 + r], joined=(wide, ranks[0]))
        runs.append((wide, planes))
    (wide, planes), (ref_wide, ref_planes) = runs
    assert torch.equal(planes, ref_planes) and torch.equal(wide, ref_wide)
    assert (planes[:, :, :2] == unwritten).all() and (planes[:, :, 2 + r:] == unwritten).all()
    assert not (wide == unwritten).any() and not (planes[:, :, 2:2 + r] == unwritten).any()


@pytest.mark.parametrize("split", [1, 3])
def test_scaled_gradients_written_by_reduce_tokens(split):
    """In one part, reduce_tokens writes scale * p^T q itself, transposed or not (no ordered sum to
    make): the bits of torch's product of its unscaled output and the scale, as at three parts;
    the products to FP32 accuracy, and zeros for no tokens."""
    M, n, r = (300, 576, 16) if not INTERPRET else (37, 24, 5)
    tiles = L.Tiles(16, 16, split=split, tc=False)
    assert L._parts(-(-n // 16), -(-M // 16), split)[0] == split
    g = torch.randn(M, n, device=DEV)
    q = torch.randn(M, r, device=DEV)
    parts = L.to_parts(q)
    db = L.reduce_tokens(g, parts, tiles)
    close(db, g.double().t() @ q.double(), g.double().abs().t() @ q.double().abs(), torch.float32)
    scaled = L.reduce_tokens(g, parts, tiles, scale=2 / 3)
    assert torch.equal(scaled, db * (2 / 3))
    dbt = L.reduce_tokens(g, parts, tiles, scale=2 / 3, transposed=True)
    assert dbt.is_contiguous() and torch.equal(dbt, scaled.t())
    assert torch.equal(L.reduce_tokens(g[:0], parts[:, :0], tiles, scale=2 / 3), torch.zeros(n, r, device=DEV))


@pytest.mark.parametrize("kind", ["decode", "cast"])
def test_deltas_joined_to_decoded_products(kind):
    """Bases whose operand is decoded for each product (NF4, decoded_kept), or casts kept with
    columns to spare beside them (`train.loop.lay_out`, as LoRA's frozen bases are laid out for a
    run), outputs at least 4x as wide as x (gate and up): each delta joins its base's GEMM along K,
    one rounding of x @ W^T + u @ B^T with u's products to 2^-15 of |u| @ |B| (no rounding of a
    delta of its own); the gradients as on the delta path, through the kept operands' columns; the
    same bits twice. An FP16 x, a rank not a multiple of 8, a Dense base without that room or
    outputs narrower than 4x take the delta path. Under the interpreter, which rounds to BF16
    toward zero, within a whole BF16 step."""
    from aner.kernels.nf4 import DevicePacked
    from aner.quant.module import NF4Module
    from aner.quant.nf4 import NF4Weight
    from aner.train.loop import lay_out
    M, n_in, shapes = 300, 64, [(192, 8), (320, 16)]            # (out, rank): a partial tile, unequal ranks
    weights = [NF4Weight.quantize(torch.randn(n, n_in) * 0.05) for n, _ in shapes]
    decodes = [NF4Module(w, device_copy=DevicePacked.from_weight(w, DEV), decoded=True, kept=True) for w in weights]
    bases = decodes
    if kind == "cast":
        bases = [Dense(base.operand(torch.bfloat16).float()) for base in decodes]
        lay_out(bases, {id(bases[0]): (24, 0, 0), id(bases[1]): (0, 48, 0)}, torch.bfloat16)
    x = torch.randn(M, n_in, device=DEV).bfloat16().requires_grad_(True)
    a_s = [(torch.randn(r, n_in, device=DEV) / n_in ** 0.5).requires_grad_(True) for _, r in shapes]
    b_s = [(torch.randn(n, r, device=DEV) * 0.1).requires_grad_(True) for n, r in shapes]
    g_s = [torch.randn(M, n, device=DEV).bfloat16() for n, _ in shapes]
    assert L._joined(bases, x, torch.bfloat16, [8, 16]) is not None
    assert L._joined(bases, x.half(), torch.float16, [8, 16]) is None
    assert L._joined(bases, x, torch.bfloat16, [8, 12]) is None
    assert L._joined([bases[0], frozen_base(n_in, 320)], x, torch.bfloat16, [8, 16]) is None
    assert L._joined(bases[:1], x, torch.bfloat16, [8]) is None            # 192 < 4 x 64
    if kind == "cast":      # the room is the two weights paired (`_paired`) as it lies: no copy, the decodes' bits
        wide = L._joined(bases, x, torch.bfloat16, [8, 16])[0]
        with torch.no_grad():
            paired = L._paired(bases, wide, b_s, (1.0, 0.5), torch.bfloat16)
            assert paired.data_ptr() == bases[0].room[0].data_ptr()
            assert torch.equal(paired, L._paired(decodes, wide, b_s, (1.0, 0.5), torch.bfloat16))
    runs = []
    for _ in range(2):
        for t in (x, *a_s, *b_s):
            t.grad = None
        outs = L.adapted_projections(bases, x, a_s, b_s)
        torch.autograd.backward(outs, g_s)
        runs.append([o.detach() for o in outs] + [t.grad for t in (x, *a_s, *b_s)])
    assert all(torch.equal(p, q) for p, q in zip(*runs))

    def within_a_step(out, ref, delta, scale, ub):                # rounded once: within half a BF16 step
        step = 2 ** -7 if INTERPRET else 2 ** -8
        assert ((out.double() - ref).abs() <= step * ref.abs() + 2 ** -15 * ub + 1e-5 * scale).all()
    # the decodes (on the GPU: dequantize() rounded)
    check_group(x, a_s, b_s, g_s, [base.operand(torch.bfloat16).double() for base in bases], outs, torch.bfloat16,
                within_a_step)


def test_a_joined_delta_below_the_outputs_step_is_kept():
    """A delta far below half the output's BF16 step, as every delta is after the first updates
    (B starts at zero and moves by about the learning rate an update), joined to its GEMM along K
    (casts laid out with room, gate's and up's shape relations): the output is the exact sum rounded
    once, the delta kept whole on average (slope 1 of out - x W^T on it; a GEMM adding a rounded
    product to it keeps ~30% on an H100, `benchmarks/delta_rounding.py`)."""
    from aner.train.loop import lay_out
    M, K, N, r = (2048, 512, 2048, 16) if not INTERPRET else (256, 512, 2048, 16)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=g) * 0.02 for _ in range(2)]
    bases = [Dense(w.bfloat16().float().to(DEV)) for w in ws]
    lay_out(bases, {id(bases[0]): (3 * r, 0, 0), id(bases[1]): (0, 3 * r, 0)}, torch.bfloat16)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEV)
    a_s = [((torch.rand(r, K, generator=g) * 2 - 1) / K ** 0.5).to(DEV) for _ in range(2)]
    b_s = [(torch.randn(N, r, generator=g).sign() * 1e-4).to(DEV) for _ in range(2)]
    assert L._joined(bases, x, torch.bfloat16, [r, r]) is not None
    with torch.no_grad():
        outs = L.adapted_projections(bases, x, a_s, b_s, (2.0, 2.0))
    for out, base, a, b in zip(outs, bases, a_s, b_s):
        product = x.double() @ base.weight.double().t()
        delta = 2.0 * (x.double() @ a.double().t()) @ b.double().t()
        rms = [float(t.pow(2).mean().sqrt()) for t in (delta, product)]
        assert rms[0] < 2 ** -9 * rms[1]                                     # below half the outputs' step
        e = out.double() - product
        assert abs(float((e * delta).sum() / (delta * delta).sum()) - 1) < 0.02
        assert float((out == (product + delta).float().bfloat16()).double().mean()) > 0.99


@pytest.mark.parametrize("kind", ["decode", "cast"])
def test_input_gradient_joined_to_decoded_product(monkeypatch, kind):
    """A base whose operand is decoded for each product (NF4, decoded and decoded_kept), or a cast
    kept with rows to spare under it (`train.loop.lay_out`), and an input at least twice as wide
    as its output (down): du @ A joins the input gradient's GEMM along K, one rounding of
    g @ W + du @ A with du's products to 2^-15 of |du| @ |A| (no rounding of du @ A of its own),
    the forward's product reading the rows above the spare ones; the output and the factors'
    gradients as on the other path; the same bits twice, and with the decode kept or made again.
    An FP16 x, a rank not a multiple of 8, a Dense base without that room, an input under twice
    the output or two bases take the other path. Under the interpreter, which rounds to BF16
    toward zero, within a whole BF16 step."""
    from aner.kernels.nf4 import DevicePacked
    from aner.quant.module import NF4Module
    from aner.quant.nf4 import NF4Weight
    from aner.train.loop import lay_out
    M, n_in, n_out, r = (300, 256, 96, 16) if not INTERPRET else (37, 128, 40, 8)
    weight = NF4Weight.quantize(torch.randn(n_out, n_in) * 0.05)
    packed = DevicePacked.from_weight(weight, DEV)
    x0 = torch.randn(M, n_in, device=DEV).bfloat16()
    a0 = torch.randn(r, n_in, device=DEV) / n_in ** 0.5
    b0 = torch.randn(n_out, r, device=DEV) * 0.1
    g = torch.randn(M, n_out, device=DEV).bfloat16()
    base = NF4Module(weight, device_copy=packed, decoded=True, kept=True)
    if kind == "cast":
        base = Dense(base.operand(torch.bfloat16).float())
        lay_out([base], {id(base): (0, 0, 3 * r)}, torch.bfloat16)
    assert L._joined_grad([base], x0, torch.bfloat16, [r]) == 3 * r
    assert L._joined_grad([base], x0.half(), torch.float16, [r]) == 0
    assert L._joined_grad([base], x0, torch.bfloat16, [r + 4]) == 0
    assert L._joined_grad([frozen_base(n_in, n_out)], x0, torch.bfloat16, [r]) == 0
    assert L._joined_grad([base], x0[:, :2 * n_out - 8], torch.bfloat16, [r]) == 0
    assert L._joined_grad([base, base], x0, torch.bfloat16, [r, r]) == 0
    joins, joined = [], L._joined_input_grad
    monkeypatch.setattr(L, "_joined_input_grad", lambda *args: joins.append(1) or joined(*args))

    def run(kept):
        x, a, b = (t.clone().requires_grad_(True) for t in (x0, a0, b0))
        made = base if kind == "cast" else NF4Module(weight, device_copy=packed, decoded=True, kept=kept)
        out = L.adapted_projection(made, x, a, b, 2.0)
        out.backward(g)
        return [out.detach(), x.grad, a.grad, b.grad], x, a, b
    runs = [run(True), run(True), run(False)]
    assert len(joins) == 3
    assert all(torch.equal(p, q) for other in runs[1:] for p, q in zip(runs[0][0], other[0]))
    (out, dx, da, db), x, a, b = runs[0]
    w = base.operand(torch.bfloat16).double()                 # the decode (on the GPU: dequantize() rounded)
    xd, ad, bd, gd = x.detach().double(), a.detach().double(), 2.0 * b.detach().double(), g.double()
    u, du = xd @ ad.t(), gd @ bd
    step = 2 ** -7 if INTERPRET else 2 ** -8
    ub = du.abs() @ ad.abs()
    assert ((dx.double() - gd @ w - du @ ad).abs() <= step * (gd @ w + du @ ad).abs() + 2 ** -15 * ub
            + 1e-5 * (gd.abs() @ w.abs() + ub)).all()
    delta = u @ bd.t()
    close(out, xd @ w.t() + delta, xd.abs() @ w.abs().t() + xd.abs() @ ad.abs().t() @ bd.abs().t(), torch.bfloat16,
          EPS[torch.bfloat16] * delta.abs())
    close(da, du.t() @ xd, (gd.abs() @ bd.abs()).t() @ xd.abs(), torch.float32)
    close(db, 2.0 * gd.t() @ u, 2.0 * gd.abs().t() @ (xd.abs() @ ad.abs().t()), torch.float32)


@pytest.mark.parametrize("kind", ["dense", "decoded"])
def test_scales_as_torch_scales_b(kind):
    """Each adapter's scale taken by the kernels that read B (and by the sum of dB's parts) gives
    the bits of the scale multiplying B by torch first, forward and every gradient, subnormal
    products and a negative zero included: on the delta path (Dense bases) and with the deltas
    joined to decoded NF4 products (BF16)."""
    M, n_in, shapes = (300, 64, [(192, 8), (320, 16)]) if not INTERPRET else (37, 16, [(24, 8), (40, 16)])
    dtype = torch.bfloat16 if kind == "decoded" else torch.float32
    if kind == "decoded":
        from aner.kernels.nf4 import DevicePacked
        from aner.quant.module import NF4Module
        from aner.quant.nf4 import NF4Weight
        weights = [NF4Weight.quantize(torch.randn(n, n_in) * 0.05) for n, _ in shapes]
        bases = [NF4Module(w, device_copy=DevicePacked.from_weight(w, DEV), decoded=True, kept=True) for w in weights]
        assert L._joined(bases, torch.empty(M, n_in, device=DEV, dtype=dtype), dtype, [8, 16]) is not None
    else:
        bases = [frozen_base(n_in, n) for n, _ in shapes]
    scales = [32 / 12, 32 / 8 ** 0.5]                             # LoRA's and rsLoRA's, not powers of two
    x0 = torch.randn(M, n_in, device=DEV).to(dtype)
    a0 = [torch.randn(r, n_in, device=DEV) / n_in ** 0.5 for _, r in shapes]
    b0 = [torch.randn(n, r, device=DEV) * 0.1 for n, r in shapes]
    b0[0][:, 0] = torch.randn(shapes[0][0], device=DEV) * 1e-39          # subnormal products kept, not flushed:
    b0[0][0, 0] = -0.0                                                   # they alone make du's first column
    g_s = [torch.randn(M, n, device=DEV).to(dtype) for n, _ in shapes]

    def run(inside):
        x, *ab = (t.clone().requires_grad_(True) for t in (x0, *a0, *b0))
        a_s, b_s = ab[:len(shapes)], ab[len(shapes):]
        if inside:
            outs = L.adapted_projections(bases, x, a_s, b_s, scales)
        else:
            outs = L.adapted_projections(bases, x, a_s, [s * b for s, b in zip(scales, b_s)])
        torch.autograd.backward(outs, g_s)
        return [o.detach() for o in outs] + [t.grad for t in (x, *a_s, *b_s)]
    inside, before = run(True), run(False)
    assert len(inside) == 7 and all(torch.equal(p, q) for p, q in zip(inside, before))
