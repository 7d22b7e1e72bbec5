"""Launching compiled NVFP4 GEMM kernels: the split-K tile counters of eager launches
(`split_counters`; a compiled graph allocates its own), direct launches of a compiled kernel
without Triton's per-call argument binding (`run`), and launches bound to one weight
(`BoundLaunch`). Nothing here decides which kernel runs (plan.py)."""

import threading

import torch
import triton

try:
    from triton import knobs  # the launch hooks a direct launch passes on, as Triton's own launches do
except ImportError:
    knobs = None


# Split-K tile counters, zero between launches (the last split of a tile resets its counter). Eager
# launches share a buffer per (device, stream): on one stream they run in order, on two they could
# overlap. A launch captured in a CUDA graph keeps its counters for every replay, on whatever stream
# and beside whatever other graph, so it gets a slice of its own from a reserve zeroed before any
# capture (or, with none left or none made yet, before any eager call on the device, a zeroed tensor
# of its own: a fill node in the graph).
_counters: dict = {}
_retired: list = []  # eager buffers outgrown: kept, as kernels on their stream may still use them
_reserve: dict = {}  # device -> [zeroed int32 buffer, first slice not handed out]
_reserve_lock = threading.Lock()  # two threads may capture at once
# A device's reserve for captured launches: 4 MiB, 2340 launches of 448 tiles (N = 28672).
RESERVED_COUNTERS = 1 << 20


def _zeros_outside_graph_pools(numel: int, device) -> torch.Tensor:
    """torch.zeros(numel) int32 on device; on CUDA made by another thread and finished before it
    returns: a CUDA-graph tree's warm-up routes its own thread's allocations (torch 2.8 and
    later; its stream's before) to the graph's memory pool, which may hold only what the call
    returns ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"). Called outside
    captures only, once a buffer."""
    if device.type != "cuda":
        return torch.zeros(numel, dtype=torch.int32, device=device)
    made = []

    def make():
        try:
            with torch.cuda.device(device):
                made.append(torch.zeros(numel, dtype=torch.int32, device=device))
                torch.cuda.current_stream(device).synchronize()
        except BaseException as error:  # re-raised in the caller's thread
            made.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_counters(device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter for each of `tiles` output tiles, left zeroed by the launch: the
    stream's shared buffer for an eager launch, a slice of its own for a launch being captured in a
    CUDA graph (see _counters above)."""
    if _capturing(device):
        reserve = _reserve.get(device)
        span = -(-tiles // 32) * 32  # slices on 128-byte boundaries: the JIT specializes on alignment
        with _reserve_lock:
            start = None if reserve is None or reserve[1] + span > reserve[0].numel() else reserve[1]
            if start is not None:
                reserve[1] = start + span
        if start is None:
            return torch.zeros(tiles, dtype=torch.int32, device=device)  # filled at every replay
        return reserve[0][start:start + tiles]
    if device not in _reserve:
        _reserve[device] = [_zeros_outside_graph_pools(RESERVED_COUNTERS, device), 0]
    stream = current_stream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    counters = _counters.get(key)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _retired.append(counters)  # made on another stream: its memory is not freed in order
        counters = _zeros_outside_graph_pools(max(tiles, 1024), device)
        _counters[key] = counters
    return counters


def direct_launch_runs(compiled) -> bool:
    """Whether this Triton's compiled kernel launches as gemm_splitk calls it (as its own
    CompiledKernel.__getitem__ launcher does); otherwise every launch goes through the JIT function."""
    return knobs is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                    "launch_metadata"))


def _hook(hook):
    """A launch hook, or None for none (Triton 3.6 keeps its hooks in a chain that may be empty:
    then the launch metadata the hooks would read is not built either)."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (isinstance(calls, list) and not calls) else hook


def run(compiled, grid, stream, args):
    """Launch a compiled kernel as Triton's own launcher does, with its launch hooks (if any)."""
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    metadata = None if enter is None else compiled.launch_metadata(grid, stream, *args)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *args)


class BoundLaunch:
    """gemm_splitk bound to one W (tiled, with its global scale and bias; x a bf16 operand) and one
    form of x (shape, row stride, dtype, device, alignment): the set-up, the compiled kernel and
    every argument but x and the output decided once, the split partials and tile counters taken
    from buffers its stream keeps (stream order, and the kernel's wait for the previous one under
    programmatic dependent launch, keep launches on a stream from overlapping), so that a call
    costs one allocation and the launch. A call returns None where it cannot launch so (another
    current device, a CUDA graph being captured): then call gemm_splitk."""

    __slots__ = ("compiled", "grid", "device", "out_shape", "out_dtype", "partial_numel", "tiles", "weights",
                 "tail")

    def __call__(self, x):
        device = self.device
        if torch._C._cuda_getDevice() != device.index or torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = current_stream(device.index)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        if self.partial_numel:
            work = _stream_work.get((device.index, stream))
            if work is None or work[0].numel() < self.partial_numel or work[1].numel() < self.tiles:
                work = _grow_stream_work(device, stream, self.partial_numel, self.tiles)
            args = (x, x, *self.weights, out, work[0], work[1], *self.tail)
        else:
            args = (x, x, *self.weights, out, out, out, *self.tail)
        run(self.compiled, self.grid, stream, args)
        return out


# (device index, stream) -> (fp32 split partials, tile counters) of BoundLaunch calls on it;
# outgrown partials are freed in stream order (made on that stream).
_stream_work: dict = {}


def current_stream(index: int):
    return triton.runtime.driver.active.get_current_stream(index)


def _grow_stream_work(device, stream, partial_numel: int, tiles: int):
    work = _stream_work.get((device.index, stream))
    if work is None or work[0].numel() < partial_numel:
        partial = torch.empty(max(partial_numel, 1 << 16), dtype=torch.float32, device=device)
    else:
        partial = work[0]
    _stream_work[device.index, stream] = work = (partial, split_counters(device, tiles))
    return work

