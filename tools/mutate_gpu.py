"""Mutation test of the GPU-only kernel code: does the GPU test suite catch small bugs in the code
the CPU CI (the Triton interpreter, a stand-in libcublasLt) cannot run: the register-fed GEMM's
inline PTX (kernels/gemm_mma.py), the word decode and split-K sum (kernels/gemm_splitk.py), what
cuBLASLt itself does with the enum values and preferences it is given (kernels/cublaslt.py) and
the hardware e4m3 conversion of the quantize kernel (kernels/_common.py)? Every default mutation
passes the whole CPU suite (checked with --full-suite on a machine without a GPU); the optional
ones (--all) are those the CPU suite already catches, and one that crashes the process.

Each mutation is one exact-string replacement in one source file, checked to match exactly once.
The repository is never written: each run copies the package, tests and examples into a temporary
directory, mutates the copy and runs a targeted pytest selection there (working directory and
PYTHONPATH the copy; a plugin stops the run if nvfp4_inductor was imported from anywhere else, e.g.
an editable install). Up to --jobs runs share the GPU at once: the time goes into Triton compiles
on the CPU (the mutated kernels compile anew: Triton's cache key holds their source and constexpr
globals). A baseline, every selection on the unmutated copy, is queued first and runs alongside:
a mutant caught only by tests that fail in the baseline is reported inconclusive.

Outcomes: caught (a selected test failed or the run crashed), NOT caught (all passed), ran nothing
(all skipped: no GPU), timeout, error (pytest could not run), skipped (the --budget ran out, or
SIGINT / SIGTERM: the runs in flight are killed and the table of the finished ones still printed).
Expected: "caught" for real bugs; "equivalent" for the control (a cache hint only); "hard" where
a bug is real but no result changes on a normal run (an out-of-bounds read whose value is dropped,
a memory-ordering race).

    python3 tools/mutate_gpu.py                    # the GPU run (~1.5 min on an H100, at most
                                                        # --budget 510 s): table, $OUT/mutations.txt
    python3 tools/mutate_gpu.py --dry-run          # apply each to a copy, count its tests
    python3 tools/mutate_gpu.py --only mma-sign    # some mutations (names as in the table)
    python3 tools/mutate_gpu.py --all              # also the optional ones (CPU-caught, a crash)
    python3 tools/mutate_gpu.py --full-suite --timeout 1800 --budget 0   # each against tests/
"""

import argparse
import ast
import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = ("nvfp4_inductor", "tests", "examples", "pyproject.toml")  # what the tests read
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_mutant_check"]
CHECK_PLUGIN = '''"""Stops the run if nvfp4_inductor was not imported from the mutated copy."""
import os
import sys

import pytest


def pytest_collection_finish(session):
    root = os.path.realpath(os.environ["MUTANT_ROOT"])
    module = sys.modules.get("nvfp4_inductor")
    if module is None:
        import nvfp4_inductor as module
    if not os.path.realpath(module.__file__).startswith(root + os.sep):
        pytest.exit(f"nvfp4_inductor imported from {module.__file__}, not from {root}", returncode=97)
'''
WRONG_IMPORT = 97
# One run of a few tests: pytest and torch start-up (~10 s) plus a Triton compile per kernel variant,
# about two a test (the register-fed kernel for sm_90: 0.8-4.4 s each on the 2-core CPU sandbox,
# tests/helpers/compile_kernels.py). Five at once on the device's 16 cores.
JOBS = 5
TIMEOUT_S = 300  # per run
BUDGET_S = 510  # all runs: the device call's 9 minutes less start-up and the table
LOG_TAIL = 4000  # characters of each run's output kept in $OUT/mutation_logs


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    why: str  # the bug, in one line
    tests: tuple  # test files
    select: tuple  # pytest -k terms (substrings of test names), or'ed
    expect: str = "caught"  # or "equivalent" (the control), "hard" (real, but results unchanged)
    cpu_caught: str = ""  # the CPU test that already catches it
    default: bool = True  # run without --all (those the CPU suite catches are not)

    @property
    def keyword(self) -> str:
        return " or ".join(self.select)


GEMM = "tests/kernels"
KERNELS = "tests/kernels"
REG = "test_register_fed_mainloop_matches_reference"  # [layout-splits-m-n-k]
SPLITK = "test_splitk_mainloop_matches_reference"  # [m-n-k-swizzled-config]
CUBLASLT = "test_cublaslt_scaled_mm_rounds_once"  # [out_dtype-bias_dtype-per_row-m-n-k]
MMA = "nvfp4_inductor/kernels/gemm_mma.py"
SPLITK_PY = "nvfp4_inductor/kernels/gemm_splitk.py"
CUBLASLT_PY = "nvfp4_inductor/kernels/cublaslt.py"
COMMON = "nvfp4_inductor/kernels/_common.py"

MUTATIONS = (
    # --- gemm_mma.py: the register-fed mainloop (inline PTX, CUDA only) ---
    Mutation("mma-evict", MMA, 'TILED_WEIGHT_EVICTION = "evict_first"', 'TILED_WEIGHT_EVICTION = "evict_last"',
             "control: the tiled weights' L1 policy, a cache hint (performance only; on the CPU "
             "test_compile_targets' PTX check flags it, by design)",
             (GEMM,), (f"{REG}[tiled-1-1-64-64]", f"{REG}[tiled-3-9-128-512]", f"{REG}[tiled-33-16-1056-4160]",
                       "test_linear_tiled_on_cuda_matches_reference[bf16-1]"), expect="equivalent"),
    Mutation("mma-prefetch-oob", MMA, "t_next = tl.minimum(t + 1, tile_end - 1)",
             "t_next = tl.minimum(t + 1, tile_end)",
             "the prefetch clamp off by one: the last step loads one tile past its range (value unused)",
             (GEMM,), (f"{REG}[tiled-1-1-64-64]", f"{REG}[tiled-33-16-1056-4160]", f"{REG}[rows-3-2-64-1024]",
                       f"{REG}[rows-swizzled-1-8-192-1040]"), expect="hard"),
    Mutation("mma-mask", MMA, "shl.b32 m, $4, 2; and.b32 m, m, 0x01C001C0;",
             "shl.b32 m, $4, 2; and.b32 m, m, 0x01C00180;",
             "decode mask typo: code 1 of each word loses its mantissa bit (0.5 -> 0, 3 -> 2, 6 -> 4)",
             (GEMM,), (f"{REG}[tiled-1-1-64-64]", f"{REG}[rows-3-9-128-512]")),
    Mutation("mma-sign", MMA, "and.b32 s, $4, 0x80008000;", "and.b32 s, $4, 0x00008000;",
             "decode: the sign of code 7 of each word dropped (the high half of the last pair)",
             (GEMM,), (f"{REG}[tiled-3-3-80-208]", f"{REG}[rows-swizzled-1-5-96-1344]")),
    Mutation("mma-operand-swap", MMA, "c0, c1, c2, c3 = _mma(g0, h0, g1, h1, b[0], b[1],",
             "c0, c1, c2, c3 = _mma(g0, g1, h0, h1, b[0], b[1],",
             "mma A fragment registers in the wrong order (rows g + 8 and k-slots 2q + 8 swapped), first sub-step",
             (GEMM,), (f"{REG}[tiled-1-1-64-64]", f"{REG}[rows-1-17-64-320]")),
    Mutation("mma-scale-pow2", MMA, "mul.f32 b, b, 0f7B000000;", "mul.f32 b, b, 0f7B800000;",
             "e4m3 scale of rows g + 8 times 2^120 instead of 2^119 (a power of two off)",
             (GEMM,), (f"{REG}[tiled-1-1-64-64]", "test_skinny_gemm_reads_any_scale_byte[True]")),
    Mutation("mma-grouped-prmt", MMA, "[a, b, r | ((r + 4) << 4)]", "[a, b, r | (r << 4)]",
             "grouped scales (row-major W, M <= 8, K % 64 == 0): the byte permute takes row g's scale for g + 8",
             (GEMM,), (f"{REG}[rows-1-2-64-1024]", f"{REG}[rows-3-1-128-4160]")),
    Mutation("mma-tiles-k-floor", MMA, "tiles_k = tl.cdiv(K, _TILE_K)", "tiles_k = K // _TILE_K",
             "tiled W: K-tiles a tile row counted rounding down (K % 64 != 0 addresses tile rows > 0 wrong)",
             (GEMM,), (f"{REG}[tiled-1-3-80-208]", f"{REG}[tiled-3-8-192-1040]")),
    Mutation("mma-x-row-clamp", MMA, "tl.minimum(g + 8 * h, M - 1)", "tl.minimum(g + 8 * h, M)",
             "x rows >= M clamped to M, one past the last (an out-of-bounds read; the products are not stored)",
             (GEMM,), (f"{REG}[rows-3-3-80-208]", f"{REG}[tiled-1-9-128-512]"), expect="hard",
             cpu_caught="test_row_major_addressing", default=False),
    # --- gemm_splitk.py: word decode (CUDA), split-K sum, eager launch ---
    Mutation("splitk-scale-bias", SPLITK_PY, "_SCALE_BIAS: tl.constexpr = tl.constexpr(2.0**127)",
             "_SCALE_BIAS: tl.constexpr = tl.constexpr(2.0**126)",
             "bf16 operand scale s * 2^118 instead of s * 2^119 (the GPU's decode only; CPU: fp32 s * 2^-7)",
             (GEMM, KERNELS), (f"{SPLITK}[1-16-16-False-config0]", f"{SPLITK}[5-48-160-True-config1]",
                               "test_quantize_values_kernel_matches_reference[shape1]")),
    Mutation("splitk-decode-sign", SPLITK_PY,
             "shl.b32 s, v, 8; and.b32 s, s, 0x80008000;\nor.b32 m, m, s; mul.rn.bf16x2 $3",
             "shl.b32 s, v, 12; and.b32 s, s, 0x80008000;\nor.b32 m, m, s; mul.rn.bf16x2 $3",
             "word decode: the high nibbles of bytes 2, 3 take the low nibble's sign (copy-paste shift)",
             (GEMM,), (f"{SPLITK}[5-48-160-True-config1]", "test_splitk_on_tiled_weights_matches_reference[5-80-208]")),
    Mutation("splitk-relaxed", SPLITK_PY, 'tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")',
             'tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")',
             "split counter atomic relaxed: the last split may read partials not yet visible (a race)",
             (GEMM,), (SPLITK, f"{REG}[tiled-33-16-1056-4160]", f"{REG}[rows-33-1-128-4160]"), expect="hard"),
    Mutation("splitk-eager-pdl", SPLITK_PY, "REG_MMA, EVEN, 1 if PDL else 0, N,", "REG_MMA, EVEN, 2 if PDL else 0, N,",
             "eager launch on PDL loads the first tile's codes before waiting (mode 2 is the template's)",
             (GEMM,), ("test_skinny_gemm_waits_for_a_pdl_producer[codes-1-True-bf16]",
                       "test_skinny_gemm_waits_for_a_pdl_producer[codes-1-False-bf16]",
                       "test_skinny_gemm_waits_for_a_pdl_producer[codes-16-True-bf16]"),
             cpu_caught="test_compile_targets (wait before any global load)", default=False),
    Mutation("splitk-counter-reset", SPLITK_PY, "    tl.store(counter_ptr, 0, mask=last)\n", "",
             "the last split does not reset its tile's counter: the next launch never sums",
             (GEMM,), (f"{SPLITK}[5-48-160-True-config1]", f"{REG}[tiled-3-3-80-208]"),
             cpu_caught="test_splitk_mainloop_matches_reference", default=False),
    # --- cublaslt.py: the large-M GEMM (CUDA only). The CPU tests run it through a stand-in
    # libcublasLt (tests/helpers/fake_cublaslt.py), which takes the module's enum values on trust and
    # ignores the pointer mode and the split-K reduction scheme: what only the GPU can check ---
    Mutation("cublaslt-relu-bias", CUBLASLT_PY, "_EPILOGUE_BIAS = 4", "_EPILOGUE_BIAS = 6",
             "epilogue enum off: CUBLASLT_EPILOGUE_RELU_BIAS (6) for EPILOGUE_BIAS (4), negatives zeroed",
             (GEMM,), (f"{CUBLASLT}[out_dtype0-bias_dtype1-False-17-48-64]",
                       f"{CUBLASLT}[out_dtype2-bias_dtype2-False-257-1056-1040]")),
    Mutation("cublaslt-reduction", CUBLASLT_PY, "_REDUCTION_SCHEME_COMPUTE_TYPE = 2", "_REDUCTION_SCHEME_COMPUTE_TYPE = 1",
             "split-K reduction scheme INPLACE (1): partial sums rounded to bf16, not rounded once "
             "(only if the heuristic splits K; on the H100, cuBLAS 13.0, no shape tried changed: "
             "(M, N, K) from (33, 64, 8192) to (8, 64, 262144) gave bits equal to the unmutated "
             "call's)",
             (GEMM,), (f"{CUBLASLT}[out_dtype0-None-False-33-64-8192]",
                       f"{CUBLASLT}[out_dtype0-bias_dtype1-False-33-64-8192]"), expect="hard"),
    Mutation("cublaslt-pointer-host", CUBLASLT_PY, "_POINTER_MODE_DEVICE = 1", "_POINTER_MODE_DEVICE = 0",
             "alpha pointer mode HOST (0): cuBLASLt dereferences the device alpha on the host (a crash)",
             (GEMM,), (f"{CUBLASLT}[out_dtype2-None-False-17-48-64]",), default=False),
    Mutation("cublaslt-no-bias", CUBLASLT_PY, "ctypes.c_uint32(_EPILOGUE_DEFAULT if bias is None else _EPILOGUE_BIAS))",
             "ctypes.c_uint32(_EPILOGUE_DEFAULT))",
             "cuBLASLt bias epilogue dropped (the bias pointer still set, never added)",
             (GEMM,), (f"{CUBLASLT}[out_dtype0-bias_dtype1-False-17-48-64]",
                       f"{CUBLASLT}[out_dtype2-bias_dtype2-False-257-1056-1040]"),
             cpu_caught="tests/kernels/test_cublaslt.py (stand-in libcublasLt)", default=False),
    Mutation("cublaslt-ldx", CUBLASLT_PY, "ldx = x.stride(0) if m > 1 else k", "ldx = k",
             "cuBLASLt x layout assumes contiguous rows (a row slice of a wider x read wrong)",
             (GEMM,), (f"{CUBLASLT}[out_dtype0-None-False-257-1056-1040]",
                       f"{CUBLASLT}[out_dtype2-None-False-33-64-8192]"),
             cpu_caught="tests/kernels/test_cublaslt.py (stand-in libcublasLt)", default=False),
    # --- _common.py: the quantize kernel's hardware e4m3 encode (sm_90) ---
    Mutation("e4m3-double-round", COMMON, "return t.to(tl.float8e4nv).to(tl.uint8, bitcast=True)",
             "return t.to(tl.float16).to(tl.float8e4nv).to(tl.uint8, bitcast=True)",
             "hardware e4m3 encode through fp16: double rounding near e4m3 ties",
             (KERNELS,), ("test_quantize_kernel_matches_reference[static-False-shape4]",
                          "test_quantize_kernel_matches_reference[dynamic-True-shape3]",
                          "test_rounding_helpers_match_the_reference[True]")),
)


def check_mutation(m: Mutation) -> str:
    """The source file's text with the mutation applied; raises unless `old` occurs exactly once
    and a mutated .py file still parses."""
    text = (REPO / m.path).read_text()
    count = text.count(m.old)
    if count != 1:
        raise ValueError(f"{m.name}: {m.path} holds {count} copies of {m.old!r}, not 1")
    mutated = text.replace(m.old, m.new)
    ast.parse(mutated, filename=m.path)
    return mutated


def make_copy(parent: Path, name: str) -> Path:
    """The package, tests and examples copied under parent/name, with the import-check plugin."""
    root = parent / name
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for entry in COPIED:
        src = REPO / entry
        if src.is_dir():
            shutil.copytree(src, root / entry, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, root / entry)
    (root / "_mutant_check.py").write_text(CHECK_PLUGIN)
    return root


def pytest_command(files, keyword, stop_first=True, collect=False) -> list:
    cmd = PYTEST + (["-x"] if stop_first else []) + (["--collect-only"] if collect else []) + list(files)
    return cmd + (["-k", keyword] if keyword else [])


def shell_line(cmd) -> str:
    return " ".join(["python3"] + [shlex.quote(a) for a in cmd[1:]])


def summary_counts(output: str) -> dict:
    """pytest's last summary line -> {'passed': n, 'failed': n, ...}."""
    counts = {}
    for line in reversed(output.strip().splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line)
        if found and (" in " in line or "no tests ran" in line):
            for n, what in found:
                counts["error" if what.startswith("error") else what] = int(n)
            break
    return counts


def failed_tests(output: str) -> list:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


@dataclasses.dataclass
class Run:
    name: str
    outcome: str = "skipped"
    detail: str = ""
    seconds: float = 0.0
    failed: list = dataclasses.field(default_factory=list)
    output: str = ""


class Runner:
    """Runs pytest commands in copies, at most `jobs` at once, all before a deadline; kills the
    process groups still running on a timeout or an interrupt."""

    def __init__(self, workdir: Path, timeout_s: float, deadline: float, jobs: int):
        self.workdir, self.timeout_s, self.deadline, self.jobs = workdir, timeout_s, deadline, jobs
        self.procs: set = set()
        self.lock = threading.Lock()
        self.stopped = False

    def kill_all(self):
        with self.lock:
            self.stopped = True
            for proc in list(self.procs):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def run(self, name: str, mutation, files, keyword, stop_first=True) -> Run:
        result = Run(name)
        left = self.deadline - time.monotonic()
        if left < 20:
            result.detail = "budget spent before it started"
            return result
        root = make_copy(self.workdir, name)
        try:
            if mutation is not None:
                (root / mutation.path).write_text(check_mutation(mutation))
            cmd = pytest_command(files, keyword, stop_first)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                   "MUTANT_ROOT": str(root), "PYTHONDONTWRITEBYTECODE": "1",
                   "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 4) // self.jobs))}
            limit = min(self.timeout_s, left)
            start = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            with self.lock:
                self.procs.add(proc)
                if self.stopped:  # interrupted while this run was starting
                    os.killpg(proc.pid, signal.SIGKILL)
            try:
                output, _ = proc.communicate(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                timed_out = True
            finally:
                with self.lock:
                    self.procs.discard(proc)
            result.seconds = time.monotonic() - start
            result.output = output
            classify(result, proc.returncode, timed_out, limit)
            if self.stopped:  # killed by an interrupt, not by the mutant
                result.outcome, result.detail = "skipped", "interrupted"
            if mutation is None:  # the baseline: nothing to catch
                result.outcome = {"NOT caught": "passed", "caught": "FAILED"}.get(result.outcome, result.outcome)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return result


def classify(result: Run, rc: int, timed_out: bool, limit: float) -> None:
    counts = summary_counts(result.output)
    result.failed = failed_tests(result.output)
    ran = ", ".join(f"{n} {what}" for what, n in counts.items() if what != "deselected")
    if timed_out:
        result.outcome, result.detail = "timeout", f"after {limit:.0f} s ({ran or 'no summary'})"
    elif rc == WRONG_IMPORT:
        result.outcome, result.detail = "error", "nvfp4_inductor not imported from the copy"
    elif rc < 0:
        result.outcome, result.detail = "caught", f"crashed (signal {-rc})"
    elif rc == 1:
        result.outcome = "caught"
        result.detail = f"{ran}; first: {result.failed[0].split('::')[-1] if result.failed else '?'}"
    elif rc == 0 and counts.get("passed", 0) > 0:
        result.outcome, result.detail = "NOT caught", ran
    elif rc == 0 or rc == 5:
        result.outcome, result.detail = "ran nothing", ran or "no tests collected"
    else:
        result.outcome, result.detail = "error", f"pytest exit {rc} ({ran or 'no summary'})"


def repo_digest(paths) -> str:
    digest = hashlib.sha256()
    for path in sorted(set(paths)):
        digest.update((REPO / path).read_bytes())
    return digest.hexdigest()


def header() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        gpu = "no GPU (nvidia-smi)"
    versions = []
    for package in ("torch", "triton", "pytest"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} -")
    return f"{gpu}; {', '.join(versions)}"


def table(mutations, runs, baseline: Run, wall_s: float, flags: bool = True) -> str:
    """The results, one line a mutation; flags: mark outcomes other than expected (the GPU run's)."""
    baseline_failed = {t.split("::")[-1] for t in baseline.failed}
    lines = [f"# mutate_gpu: {header()}",
             f"# baseline (every selection, unmutated): {baseline.outcome} - {baseline.detail} "
             f"({baseline.seconds:.0f} s)"]
    if baseline_failed:
        lines.append(f"# baseline failures (a mutant caught only by these is inconclusive): {sorted(baseline_failed)}")
    lines.append(f"{'mutation':22} {'file':15} {'expect':10} {'outcome':11} {'s':>5}  detail")
    outcomes = {}
    for m in mutations:
        run = runs[m.name]
        outcome = run.outcome
        first = {t.split("::")[-1] for t in run.failed}
        if outcome == "caught" and first and first <= baseline_failed:
            outcome = "inconclusive"
        outcomes[m.name] = outcome
        flag = "" if (outcome == "caught") == (m.expect == "caught") else "  <-- unexpected"
        if outcome in ("timeout", "error", "skipped", "ran nothing", "inconclusive"):
            flag = "  <-- no verdict"
        flag = flag if flags else ""
        cpu = f" [CPU suite catches: {m.cpu_caught}]" if m.cpu_caught else ""
        lines.append(f"{m.name:22} {Path(m.path).name:15} {m.expect:10} {outcome:11} {run.seconds:5.0f}  "
                     f"{run.detail}{cpu}{flag}")
    caught = sum(outcomes[m.name] == "caught" for m in mutations if m.expect == "caught")
    real = sum(m.expect == "caught" for m in mutations)
    lines.append(f"# {caught} of {real} expected-caught mutants caught; wall {wall_s:.0f} s")
    return "\n".join(lines)


def dry_run(mutations, workdir: Path, collect: bool) -> int:
    """Applies each mutation to a copy and checks it; prints the command and how many tests it selects."""
    before = repo_digest(m.path for m in mutations)
    status = 0
    for m in mutations:
        try:
            root = make_copy(workdir, m.name)
            (root / m.path).write_text(check_mutation(m))
            assert (root / m.path).read_text().count(m.new) >= 1 and (root / m.path).read_text() != \
                (REPO / m.path).read_text()
            count = ""
            if collect:
                env = {**os.environ, "PYTHONPATH": str(root), "MUTANT_ROOT": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
                out = subprocess.run(pytest_command(m.tests, m.keyword, collect=True), cwd=root, env=env,
                                     capture_output=True, text=True, timeout=300).stdout
                selected = re.findall(r"^tests/\S+::", out, flags=re.M)
                count = f" [{len(selected)} tests]"
            print(f"ok   {m.name:22} {m.path}: 1 match{count}  ({m.expect}"
                  f"{'; CPU-caught: ' + m.cpu_caught if m.cpu_caught else ''})")
            print(f"     {m.why}")
            print(f"     {shell_line(pytest_command(m.tests, m.keyword))}")
        except Exception as error:  # noqa: BLE001 (reported per mutation)
            status = 1
            print(f"FAIL {m.name}: {type(error).__name__}: {error}")
        finally:
            shutil.rmtree(workdir / m.name, ignore_errors=True)
    after = repo_digest(m.path for m in mutations)
    print(f"repository sources unchanged: {before == after}")
    return status if before == after else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="apply each to a copy and print the commands")
    parser.add_argument("--no-collect", action="store_true", help="dry run: do not count the selected tests")
    parser.add_argument("--only", nargs="+", help="mutation names")
    parser.add_argument("--all", action="store_true",
                        help="also the optional mutations (those the CPU suite catches, the crash)")
    parser.add_argument("--full-suite", action="store_true", help="run all of tests/ (no -k) for each")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a run")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all runs (0: none)")
    args = parser.parse_args()

    mutations = [m for m in MUTATIONS if (args.only and m.name in args.only)
                 or (not args.only and (args.all or m.default))]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations {sorted(unknown)}; known: {[m.name for m in MUTATIONS]}")
    with tempfile.TemporaryDirectory(prefix="mutate_gpu_") as tmp:
        workdir = Path(tmp)
        if args.dry_run:
            return dry_run(mutations, workdir, not args.no_collect)
        broken = {}  # a pattern the sources no longer hold: reported, the others still run
        for m in mutations:
            try:
                check_mutation(m)
            except (ValueError, SyntaxError, OSError) as error:
                broken[m.name] = Run(m.name, "error", f"pattern: {error}")
        start = time.monotonic()
        deadline = start + (args.budget if args.budget > 0 else 1e9)
        runner = Runner(workdir, args.timeout, deadline, args.jobs)
        print(f"# {header()}; {len(mutations)} mutations, {args.jobs} at once, budget {args.budget:.0f} s", flush=True)
        files = sorted({f for m in mutations for f in m.tests})
        jobs = [("baseline", None, ("tests",) if args.full_suite else files,
                 None if args.full_suite else " or ".join(f"({m.keyword})" for m in mutations), False)]
        jobs = ([] if args.no_baseline else jobs) + [
            (m.name, m, ("tests",) if args.full_suite else m.tests, None if args.full_suite else m.keyword, True)
            for m in mutations if m.name not in broken]
        runs = dict(broken)
        for run in broken.values():
            print(f"  {run.name:22} {run.outcome:11}       {run.detail}", flush=True)
        interrupted = []

        def on_signal(signum, _frame):
            interrupted.append(signum)
            runner.kill_all()

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)

        def one(job):
            name, mutation, job_files, keyword, stop_first = job
            if interrupted:
                return Run(name, detail="interrupted")
            run = runner.run(name, mutation, job_files, keyword, stop_first)
            print(f"  {name:22} {run.outcome:11} {run.seconds:5.0f} s  {run.detail}", flush=True)
            return run

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for run in pool.map(one, jobs):
                runs[run.name] = run
        baseline = runs.get("baseline", Run("baseline", "not run", "--no-baseline"))
        text = table(mutations, runs, baseline, time.monotonic() - start, flags=not args.full_suite)
        print(text)
        out = os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "mutations.txt").write_text(text + "\n")
            logs = Path(out) / "mutation_logs"
            logs.mkdir(exist_ok=True)
            for run in runs.values():
                (logs / f"{run.name}.txt").write_text(run.output[-LOG_TAIL:])
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
