"""One micro-batch's forward and backward recorded as a CUDA graph and replayed (profile
`cuda_graphs=True`).

Eager, a micro-batch issues thousands of small kernels, one Python dispatch each; on a small
model the GPU waits for the host. A graph records those launches once per micro-batch shape
(B, T) and count of rows the head reads (`loss.batch`: a multiple of 128, or all) and replays
them with one call: the same kernels with the same arguments in the same order, so a replay gives
the bits of the eager pass it recorded. Inputs are copied into the graph's own tensors before a
replay. Outputs: the loss is the graph's tensor; the gradients are the first recorded shape's own
gradient tensors, into which every later shape's graph copies its gradients (exactly): one set
for the run, as eager holds. Both are overwritten by the next replay of any recorded shape, so
the caller consumes them first.

Recording a shape costs one eager warm-up pass (it compiles kernels and creates library handles
outside the recording) and the recording itself. Every graph of a run allocates its activations
and temporaries from one memory pool, reused across shapes because no output outlives a replay;
the pool and the gradient buffers are released when the run returns. At most MAX_SHAPES shapes
are recorded; further shapes run eagerly.
"""
import torch

MAX_SHAPES = 4


class Graphed:
    """fn(inputs, targets, rows, scale) -> (loss, grads), recorded per shape of `inputs` and count
    of `rows` (None: every position)."""

    def __init__(self, fn):
        self.fn = fn
        self.pool = torch.cuda.graph_pool_handle()
        self.grads = None    # the first shape's gradient outputs, which every recorded shape writes
        self.recorded = {}   # ((B, T), rows) -> ((static inputs, targets, rows, scale), graph, loss)

    def __call__(self, inputs, targets, rows, scale):
        key = tuple(inputs.shape), None if rows is None else len(rows)
        if key not in self.recorded:
            if len(self.recorded) == MAX_SHAPES:
                return self.fn(inputs, targets, rows, scale)
            self.recorded[key] = self._record(inputs, targets, rows, scale)
        static, graph, loss = self.recorded[key]
        for mine, given in zip(static, (inputs, targets, rows, scale)):
            if given is not None:
                mine.copy_(given)
        graph.replay()
        return loss, self.grads

    def _record(self, inputs, targets, rows, scale):
        static = tuple(None if t is None else t.clone() for t in (inputs, targets, rows, scale))
        side = torch.cuda.Stream(inputs.device)
        side.wait_stream(torch.cuda.current_stream(inputs.device))
        with torch.cuda.stream(side):
            _, grads = self.fn(*static)           # warm-up; its results are dropped
        torch.cuda.current_stream(inputs.device).wait_stream(side)
        del grads
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            loss, grads = self.fn(*static)
            if self.grads is None:
                self.grads = list(grads)
            else:
                torch._foreach_copy_(self.grads, grads)
        return static, graph, loss
