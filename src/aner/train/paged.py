"""Paged AdamW: FP32 moments in pinned host memory, streamed through the GPU chunk by chunk.

Parameters and gradients stay on the GPU; each moment is split into `page_bytes` chunks. Two GPU
buffer pairs form the window: while the default stream updates chunk k in one pair, a side
stream copies chunk k+1 in (host -> device) and chunk k-1 back out (device -> host) through the
other, ordered by CUDA events. The arithmetic is `AdamW.update` on slices: elementwise, so the
result is bitwise the same as the resident optimizer's. Managed (unified) memory is not used.

This is moment paging, not model offloading and not an 8-bit optimizer: it frees GPU memory of
2 x 4 bytes per trainable parameter at the cost of PCIe traffic (two moments in and out per step).
"""
from dataclasses import dataclass

import torch

from .optim import AdamW, step_count


@dataclass(frozen=True)
class PagedAdamW:
    adamw: AdamW
    page_bytes: int
    device: str

    def init_moments(self, params: dict) -> dict:
        return {n: (torch.zeros(p.shape, dtype=torch.float32, pin_memory=True),
                    torch.zeros(p.shape, dtype=torch.float32, pin_memory=True)) for n, p in params.items()}

    @torch.no_grad()
    def step(self, params: dict, grads: dict, moments: dict, t: int, divisor=None, casts=None) -> None:
        step = self.page_bytes // 4
        chunks = [(n, s, min(s + step, params[n].numel())) for n in sorted(params)
                  for s in range(0, params[n].numel(), step)]
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        bufs = [(torch.empty(step, device=self.device), torch.empty(step, device=self.device)) for _ in range(2)]
        loaded = [torch.cuda.Event() for _ in range(2)]
        computed = [torch.cuda.Event() for _ in range(2)]
        count = step_count(t, self.device)
        casts = casts or {}
        side.wait_stream(main)  # gradients are complete before any chunk moves

        def load(k):
            name, s, e = chunks[k]
            bm, bv = bufs[k % 2]
            m, v = moments[name]
            with torch.cuda.stream(side):
                bm[:e - s].copy_(m.view(-1)[s:e], non_blocking=True)
                bv[:e - s].copy_(v.view(-1)[s:e], non_blocking=True)
                loaded[k % 2].record(side)

        load(0)
        for k, (name, s, e) in enumerate(chunks):
            b = k % 2
            if k + 1 < len(chunks):
                load(k + 1)  # the side stream issued chunk k-1's write-back first, so its buffer is free
            main.wait_event(loaded[b])
            bm, bv = bufs[b]
            cast = casts.get(name)
            self.adamw.update([params[name].view(-1)[s:e]], [grads[name].view(-1)[s:e]], [bm[:e - s]], [bv[:e - s]],
                              count, divisor, [None if cast is None else cast.view(-1)[s:e]])
            computed[b].record(main)
            m, v = moments[name]
            with torch.cuda.stream(side):
                side.wait_event(computed[b])
                m.view(-1)[s:e].copy_(bm[:e - s], non_blocking=True)
                v.view(-1)[s:e].copy_(bv[:e - s], non_blocking=True)
                for buf in (bm, bv):
                    buf.record_stream(side)
        main.wait_stream(side)
        side.synchronize()  # host moments are complete before anyone reads or saves them
