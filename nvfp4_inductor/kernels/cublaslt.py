"""One cuBLASLt call for the large-M linear: y = alpha * (x @ w^T) + bias, alpha read on the device.

Large M dequantizes the NVFP4 weight to bf16 (e2m1 * block scale, exact) and multiplies with
cuBLAS. The global scale g is a device tensor, and torch's GEMMs take alpha only as a host float:
reading g back would be a host sync (not allowed under CUDA graphs), and folding it into the bf16
weight rounds (3e-3 relative error, measured). An fp32 product and a second pass applying g and
the bias is markedly slower than the bf16 GEMM (docs/gemm.md). cuBLASLt reads alpha from device
memory (CUBLASLT_POINTER_MODE_DEVICE) and adds the bias in its epilogue, in fp32, rounding once to
the output type: the reference's numbers, no fp32 (M, N) product, no sync. Per-row global scales (a
vector alpha) keep the fp32 product and the second pass: CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_
BETA_ZERO is not supported for bf16 GEMMs (cuBLAS 13.0: CUBLAS_STATUS_NOT_SUPPORTED).

Row-major torch tensors as cuBLAS's column-major ones: y (M, N) row-major is D = y^T (N x M,
ld = N); D = op(A) @ B with A = w read as a (K x N, ld = K) matrix, transposed, and B = x^T
(K x M, ld = x.stride(0)). The bias is a vector over D's rows (N).

The library is the libcublasLt that torch itself loaded (found in /proc/self/maps), called through
ctypes: the enum values below are those of cublasLt.h / library_types.h (those used here checked
against CUDA 13.0's header).
"""

import collections
import ctypes
import threading

import torch

# library_types.h / cublas_api.h
_CUBLAS_STATUS_NOT_SUPPORTED = 15
_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_POINTER_MODE = 2
_DESC_TRANSA = 3
_DESC_TRANSB = 4
_DESC_EPILOGUE = 7
_DESC_BIAS_POINTER = 8
# cublasLtPointerMode_t
_POINTER_MODE_DEVICE = 1
# cublasLtEpilogue_t
_EPILOGUE_DEFAULT = 1
_EPILOGUE_BIAS = 4
# cublasLtMatmulPreferenceAttributes_t, cublasLtReductionScheme_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_REDUCTION_SCHEME_COMPUTE_TYPE = 2  # split-K partial sums in fp32 (not in the output type)
_PREF_MIN_ALIGNMENT_BYTES = {"a": 5, "b": 6, "c": 7, "d": 8}

WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper; some split-K kernels use it
_MAX_PLANS = 256  # cached (shape, dtype, alignment) descriptors; the oldest are destroyed beyond
_OUT_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float32: _CUDA_R_32F}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


_lock = threading.Lock()
_lib = None
_handles: dict = {}  # device index -> cublasLtHandle_t
_plans: collections.OrderedDict = collections.OrderedDict()


def _library():
    global _lib
    if _lib is None:
        # torch's: the one of its CUDA's major version (another library in the process may have
        # mapped a libcublasLt of another CUDA); not mapped yet: that soname
        soname = f"libcublasLt.so.{torch.version.cuda.split('.')[0]}"
        path = soname
        with open("/proc/self/maps") as maps:
            for line in maps:
                mapped = line.split()[-1]
                base = mapped.rsplit("/", 1)[-1]
                if base == soname or base.startswith(soname + "."):
                    path = mapped
                    break
        lib = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64,
                                           ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                               ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                               ctypes.POINTER(_HeuristicResult), vp, sz, vp],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed: cublasStatus_t {status}")


def _set(setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


def _handle(device: torch.device):
    handle = _handles.get(device.index)
    if handle is None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):  # the handle takes the current device's properties
            _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handles[device.index] = handle
    return handle


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two (<= 256) dividing the tensor's address."""
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


class _Plan:
    """Descriptors and the heuristic's algorithm for one (shape, dtype, alignment) key."""

    def __init__(self, device, m, n, k, ldx, out_dtype, bias, alignments):
        vp = ctypes.c_void_p
        self.desc, self.a, self.b, self.d = vp(), vp(), vp(), vp()
        try:  # a failed step destroys what the earlier ones made (a failing shape is planned at every call)
            self._create(device, m, n, k, ldx, out_dtype, bias, alignments)
        except BaseException:
            self.destroy()
            raise

    def _create(self, device, m, n, k, ldx, out_dtype, bias, alignments):
        lib, vp = _library(), ctypes.c_void_p
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_POINTER_MODE, ctypes.c_int32(_POINTER_MODE_DEVICE))
        _set(set_desc, self.desc, _DESC_TRANSA, ctypes.c_int32(_CUBLAS_OP_T))
        _set(set_desc, self.desc, _DESC_TRANSB, ctypes.c_int32(_CUBLAS_OP_N))
        _set(set_desc, self.desc, _DESC_EPILOGUE,
             ctypes.c_uint32(_EPILOGUE_DEFAULT if bias is None else _EPILOGUE_BIAS))
        if bias is not None:  # (the heuristic reads its alignment from the address)
            self.set_bias(bias)
        for layout, (dtype, rows, cols, ld) in zip(
                (self.a, self.b, self.d),
                ((_CUDA_R_16BF, k, n, k), (_CUDA_R_16BF, k, m, ldx), (_OUT_DTYPES[out_dtype], n, m, n))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            set_pref = lib.cublasLtMatmulPreferenceSetAttribute
            _set(set_pref, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
            # no split-K reduction in bf16 (the in-place and output-type schemes): the sums stay
            # fp32 until the one rounding (torch does the same when bf16 reduced-precision
            # reduction is off)
            _set(set_pref, pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_SCHEME_COMPUTE_TYPE))
            for name, align in alignments.items():
                _set(set_pref, pref, _PREF_MIN_ALIGNMENT_BYTES[name], ctypes.c_uint32(align))
            self.algo, count = _HeuristicResult(), ctypes.c_int(0)
            status = lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(device), self.desc, self.a, self.b, self.d, self.d, pref, 1,
                ctypes.byref(self.algo), ctypes.byref(count))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        # (no algorithm: a count of 0, or CUBLAS_STATUS_NOT_SUPPORTED, which cuBLAS 13 returns)
        if status == _CUBLAS_STATUS_NOT_SUPPORTED or (status == 0 and count.value < 1):
            raise CublasLtError(f"cuBLASLt has no algorithm for x ({m}, {k}) @ w ({n}, {k})^T -> "
                                f"{out_dtype} (bias {bias is not None}, alignments {alignments})")
        _check(status, "cublasLtMatmulAlgoGetHeuristic")

    def set_bias(self, bias: torch.Tensor) -> None:
        _set(_library().cublasLtMatmulDescSetAttribute, self.desc, _DESC_BIAS_POINTER,
             ctypes.c_void_p(bias.data_ptr()))

    def destroy(self):
        lib = _library()
        if self.desc.value:
            lib.cublasLtMatmulDescDestroy(self.desc)
        for layout in (self.a, self.b, self.d):
            if layout.value:
                lib.cublasLtMatrixLayoutDestroy(layout)


def scaled_mm(x: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) bf16 @ w (N, K) bf16 ^T -> (M, N) out_dtype = alpha * product + bias, in fp32 and
    rounded once. alpha: fp32 device tensor, () (read by cuBLASLt) or (N,) (per-row: the fp32
    product, then one pass); bias: (N,), any float dtype. The GEMM writes bf16 or fp32 and takes
    a bias of that type; otherwise (fp16 out: cuBLASLt has no bf16 x bf16 -> fp16 GEMM; or a bias
    of another dtype than the output) it writes fp32 with the bias in fp32 and the result is
    rounded after: the same single rounding."""
    if bias is not None and (bias.stride(0) != 1 or bias.data_ptr() % 16):
        bias = bias.clone(memory_format=torch.contiguous_format)
    if out_dtype not in _OUT_DTYPES or (bias is not None and bias.dtype != out_dtype):
        return scaled_mm(x, w, alpha, None if bias is None else bias.float(), torch.float32).to(out_dtype)
    m, k = x.shape
    n = w.shape[0]
    if not (x.dtype == w.dtype == torch.bfloat16 and x.is_cuda and w.device == x.device
            and w.shape[1] == k):
        raise ValueError(f"scaled_mm: x (M, K) and w (N, K) bf16 on one CUDA device; got x {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}, w {w.dtype} {tuple(w.shape)} on {w.device}")
    # Rows of unit stride on 16-byte boundaries, or a copy: with a 2-byte aligned x and the bias
    # epilogue cuBLAS 13.0 does not round once; the package's K is a multiple of 16, so a
    # contiguous copy is aligned. The same for w (a contiguous view can start anywhere).
    if x.stride(1) != 1 or (m > 1 and (x.stride(0) < k or x.stride(0) % 8)) or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    w = w.contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    if alpha.dtype != torch.float32 or alpha.device != x.device or alpha.shape not in ((), (n,)):
        raise ValueError(f"scaled_mm: alpha must be fp32 () or ({n},) on {x.device}, got "
                         f"{alpha.dtype} {tuple(alpha.shape)} on {alpha.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"scaled_mm: bias must be ({n},) on {x.device}, got {tuple(bias.shape)} on "
                         f"{bias.device}")
    rows_align = 16 // out_dtype.itemsize  # output elements a 16-byte step
    if n % rows_align and alpha.dim() == 0 and m > 0:
        # Output rows off 16-byte boundaries (N = 1004 or 13 in bf16): with the bias epilogue the
        # results are not rounded once (relative error 2.2-2.4e-3, cuBLAS 13.0). Zero
        # rows pad w and the bias to the next boundary; the columns past N are dropped.
        pad = -n % rows_align
        w = torch.nn.functional.pad(w, (0, 0, 0, pad))
        bias = None if bias is None else torch.nn.functional.pad(bias, (0, pad))
        return scaled_mm(x, w, alpha, bias, out_dtype)[:, :n].contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if alpha.dim() == 1:  # per-row scales: the fp32 product, then one pass (module docstring)
        y = torch.mm(x, w.T, out_dtype=torch.float32)
        out = y if out_dtype == torch.float32 else out
        if bias is None:
            return torch.mul(y, alpha, out=out)
        return torch.addcmul(bias.float(), y, alpha, out=out)
    ldx = x.stride(0) if m > 1 else k
    alignments = {"a": _alignment(w), "b": _alignment(x), "c": _alignment(out), "d": _alignment(out)}
    key = (x.device.index, m, n, k, ldx, out_dtype, bias is not None,
           _alignment(bias) if bias is not None else 0, *alignments.values())
    device = x.device
    stream = torch.cuda.current_stream(device).cuda_stream
    # beta (0: the pointer mode makes it a device pointer too) and the workspace are allocated per
    # call, so they follow the stream and memory pool of the call (a CUDA graph's included): a
    # cached buffer first made while CUDA-graph trees record lives in their pool untracked, which
    # they refuse. Both come from the caching allocator; beta costs one fill kernel.
    beta = torch.zeros((), dtype=torch.float32, device=device)
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    lib = _library()
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _Plan(device, m, n, k, ldx, out_dtype, bias, alignments)
            _plans[key] = plan
            if len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)[1].destroy()
        else:
            _plans.move_to_end(key)
        if bias is not None:
            plan.set_bias(bias)
        _check(lib.cublasLtMatmul(
            _handle(device), plan.desc, alpha.data_ptr(), w.data_ptr(), plan.a, x.data_ptr(), plan.b,
            beta.data_ptr(), out.data_ptr(), plan.d, out.data_ptr(), plan.d,
            ctypes.byref(plan.algo), ws.data_ptr(), WORKSPACE_BYTES, stream), "cublasLtMatmul")
    return out
