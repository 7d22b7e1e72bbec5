"""A CPU stand-in for libcublasLt, for the tests of kernels/cublaslt.py without a GPU.

It keeps the descriptors kernels/cublaslt.py creates (counting creations and destructions) and
runs cublasLtMatmul on host memory through the pointers and column-major layouts it is given,
as cuBLASLt reads device memory: D = alpha * op(A) @ op(B) (+ beta * C) (+ bias), in fp32,
rounded once to D's type; an operand less aligned than the plan's preference said is refused.
`FakeLib(fail=name, status=s)` makes one entry point return s.
`on_fake_cuda` installs it and lets CPU tensors through scaled_mm's CUDA checks (`cuda(t)`).
"""

import contextlib
import ctypes

import torch

from nvfp4_inductor.kernels import cublaslt as lt

_DTYPES = {lt._CUDA_R_16BF: torch.bfloat16, lt._CUDA_R_32F: torch.float32}
_ENTRY_POINTS = (
    "cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy",
    "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul",
)


def _read(ptr: int, dtype, rows: int, cols: int, ld: int) -> torch.Tensor:
    """The column-major (rows, cols) matrix at ptr, column j at ptr + j * ld elements."""
    size = dtype.itemsize
    raw = bytearray((ctypes.c_char * (((cols - 1) * ld + rows) * size)).from_address(ptr))
    return torch.frombuffer(raw, dtype=dtype).as_strided((rows, cols), (1, ld))


def _write(ptr: int, t: torch.Tensor, ld: int) -> None:
    size = t.element_size()
    for j in range(t.shape[1]):
        column = t[:, j].contiguous()
        ctypes.memmove(ptr + j * ld * size, column.data_ptr(), t.shape[0] * size)


class FakeLib:
    def __init__(self, fail: str | None = None, status: int = 7):
        self.objects, self.next_id = {}, 1
        self.created = self.destroyed = self.misaligned = 0
        self.fail, self.status = fail, status
        self.matmuls = []  # (layouts of A, B, D, the descriptor's attributes, stream)
        for name in _ENTRY_POINTS:
            impl = getattr(self, "_" + name.removeprefix("cublasLt"))

            def entry(*args, _impl=impl, _name=name):
                return self.status if _name == self.fail else _impl(*args)

            entry.__name__ = name
            setattr(self, name, entry)

    def live(self) -> int:
        """Descriptors and layouts created and not destroyed."""
        return self.created - self.destroyed

    def _new(self, out_ref, obj, counted=True) -> int:
        self.objects[self.next_id] = obj
        out_ref._obj.value = self.next_id
        self.next_id += 1
        self.created += counted
        return 0

    def _drop(self, handle) -> int:
        self.objects.pop(handle.value)
        self.destroyed += 1
        return 0

    def _Create(self, out_ref):
        return self._new(out_ref, "handle", counted=False)

    def _MatmulDescCreate(self, out_ref, compute_type, scale_type):
        return self._new(out_ref, {})

    def _MatmulDescDestroy(self, desc):
        return self._drop(desc)

    def _MatmulDescSetAttribute(self, desc, attr, value_ref, size):
        self.objects[desc.value][attr] = value_ref._obj.value
        return 0

    def _MatrixLayoutCreate(self, out_ref, dtype, rows, cols, ld):
        return self._new(out_ref, (dtype, rows, cols, ld))

    def _MatrixLayoutDestroy(self, layout):
        return self._drop(layout)

    def _MatmulPreferenceCreate(self, out_ref):
        return self._new(out_ref, {})

    def _MatmulPreferenceDestroy(self, pref):
        return self._drop(pref)

    def _MatmulPreferenceSetAttribute(self, pref, attr, value_ref, size):
        self.objects[pref.value][attr] = value_ref._obj.value
        return 0

    def _MatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, requested, result_ref, count_ref):
        # the algorithm found needs the operands' addresses as aligned as the preference said
        self.objects[desc.value]["min_alignments"] = [
            self.objects[pref.value].get(lt._PREF_MIN_ALIGNMENT_BYTES[name], 256) for name in "abcd"]
        count_ref._obj.value = 1
        return 0

    def _Matmul(self, handle, desc, alpha, a, a_layout, b, b_layout, beta, c, c_layout, d, d_layout,
                algo, workspace, workspace_size, stream):
        attrs = self.objects[desc.value]
        if any(ptr % align for ptr, align in zip((a, b, c, d), attrs["min_alignments"])):
            self.misaligned += 1  # (cuBLAS would run a kernel that assumes the alignment)
            return 7  # CUBLAS_STATUS_INVALID_VALUE
        layouts = [self.objects[x.value] for x in (a_layout, b_layout, d_layout)]
        (a_type, *a_shape), (b_type, *b_shape), (d_type, *d_shape) = layouts
        op_a = _read(a, _DTYPES[a_type], *a_shape).float()
        op_b = _read(b, _DTYPES[b_type], *b_shape).float()
        op_a = op_a.T if attrs[lt._DESC_TRANSA] == lt._CUBLAS_OP_T else op_a
        op_b = op_b.T if attrs[lt._DESC_TRANSB] == lt._CUBLAS_OP_T else op_b
        acc = _read(alpha, torch.float32, 1, 1, 1)[0, 0] * (op_a @ op_b)
        beta_value = _read(beta, torch.float32, 1, 1, 1)[0, 0]
        if beta_value != 0:
            acc = acc + beta_value * _read(c, _DTYPES[d_type], *d_shape).float()
        if attrs[lt._DESC_EPILOGUE] == lt._EPILOGUE_BIAS:
            rows = d_shape[0]
            acc = acc + _read(attrs[lt._DESC_BIAS_POINTER], _DTYPES[d_type], rows, 1, rows).float()
        self.matmuls.append((layouts, dict(attrs), stream))
        _write(d, acc.to(_DTYPES[d_type]), d_shape[2])
        return 0


class FakeCuda(torch.Tensor):
    """A CPU tensor that passes scaled_mm's is_cuda check; mm with out_dtype (which the CPU does
    not have) computed in fp32."""

    @property
    def is_cuda(self):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.mm and "out_dtype" in kwargs:
            a, b = args
            return (a.float() @ b.float()).to(kwargs["out_dtype"]).as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


def cuda(t):
    return None if t is None else t.as_subclass(FakeCuda)


STREAM = 1234


def on_fake_cuda(monkeypatch, lib: FakeLib) -> None:
    """kernels/cublaslt.py calls `lib` (no handles or plans of before), on a stand-in stream."""
    class Stream:
        cuda_stream = STREAM

    monkeypatch.setattr(lt, "_lib", lib)
    monkeypatch.setattr(lt, "_handles", {})
    monkeypatch.setattr(lt, "_plans", type(lt._plans)())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
