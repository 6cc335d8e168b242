"""Small C kernels of the engine, built once per machine and called through ctypes.

Plain C (no torch headers: a build takes about a second), compiled with the machine's own
vector width (``-march=native``) into ``$MMSERVE_CACHE_DIR/kernels`` (default ``~/.cache/mmserve``),
keyed by the source, the flags and the CPU's flags. A missing compiler or a failed build leaves
``available()`` False (logged once) and the callers on their torch path.

Where no compiler runs (the container image's runtime stage), ``$MMSERVE_KERNEL_PREBUILT`` names a
directory of builds made ahead for fixed x86-64 levels (``llm_svc.kernels.prebuild``:
``<dir>/<level>/kernels/<name>-<digest>.so``, keyed by the level instead of the CPU's flags); the
highest level this CPU runs is loaded. ``kernel_report()`` says, per kernel, which build loaded
or why none did.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
FAST_FLAGS = ("-O3", "-ffast-math", "-march=native", "-fPIC", "-std=c11")
PREBUILT_VAR = "MMSERVE_KERNEL_PREBUILT"
# x86-64 micro-architecture levels, best first, with the CPU flags (/proc/cpuinfo) each needs
LEVELS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"),
    "x86-64-v3": ("avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"),
    "x86-64-v2": ("sse4_2", "ssse3", "popcnt", "cx16"),
}
REGISTRY: list["CKernel"] = []  # every kernel defined so far (kernel_report, prebuild)


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    return frozenset(_cpu_key().split()[1:])


def cpu_runs(level: str) -> bool:
    """Whether this CPU has every flag the x86-64 ``level`` (``LEVELS``) needs."""
    flags = set(_cpu_key().split())
    return all(f in flags for f in LEVELS[level])


class CKernel:
    """One C source built into one shared library; ``bind(lib)`` declares its functions'
    ctypes signatures. ``what`` and ``fallback`` word the warning when it cannot be built.
    ``headers``: files the source includes (beside it); they are part of the build's cache key,
    so editing one rebuilds every kernel that includes it."""

    def __init__(self, source: Path, name: str, bind: Callable[[ctypes.CDLL], None], *, what: str, fallback: str,
                 flags: tuple[str, ...] = FAST_FLAGS, link_flags: tuple[str, ...] = ("-shared",),
                 libs: tuple[str, ...] = ("-lm",), headers: tuple[Path, ...] = ()):
        self.source, self.name, self.bind = source, name, bind
        self.headers = tuple(headers)
        self.what, self.fallback = what, fallback
        self.flags, self.link_flags, self.libs = tuple(flags), tuple(link_flags), tuple(libs)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.build: str | None = None  # "native" or "<level> (prebuilt)" once loaded
        self.error: str | None = None  # why neither loaded
        self.native_error: str | None = None  # why a prebuilt build was loaded instead of a native one
        REGISTRY.append(self)

    def level_flags(self, level: str | None) -> tuple[str, ...]:
        """The compile flags, ``-march=native`` replaced by ``-march=<level>`` when a level is named."""
        return self.flags if level is None else tuple(f"-march={level}" if f == "-march=native" else f
                                                      for f in self.flags)

    def library_path(self, level: str | None = None, root: Path | None = None) -> Path:
        """Where this machine's build lives (built or not); with ``level``, the build for that x86-64
        level under ``root`` (keyed by the level, not by this CPU's flags)."""
        flags = " ".join(self.level_flags(level) + ("|",) + self.link_flags + self.libs)
        code = self.source.read_bytes() + b"".join(h.read_bytes() for h in self.headers)
        digest = hashlib.sha256(code + flags.encode() + (level or _cpu_key()).encode()).hexdigest()[:16]
        if root is None:
            from shared.cache_dir import cache_root
            root = cache_root()  # $MMSERVE_CACHE_DIR ($MMSERVE_CACHE still read, deprecated)
        return root / "kernels" / f"{self.name}-{digest}.so"

    def prebuilt_path(self) -> tuple[str, Path] | None:
        """The best prebuilt build this CPU runs (``$MMSERVE_KERNEL_PREBUILT``), as (level, path)."""
        base = os.environ.get(PREBUILT_VAR)
        if not base:
            return None
        for level in LEVELS:
            path = self.library_path(level, Path(base) / level)
            if path.exists() and cpu_runs(level):
                return level, path
        return None

    def _build(self, out: Path, level: str | None = None) -> None:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc / gcc) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            # compiled with -ffast-math, linked without it: gcc links crtfastmath.o into any object
            # it links under -ffast-math, and that sets flush-to-zero / denormals-are-zero for the
            # whole process the moment the library loads (every float op of the service, not ours)
            obj = tmp + ".o"
            try:
                subprocess.run([cc, *self.level_flags(level), "-c", str(self.source), "-o", obj], check=True,
                               capture_output=True,
                               text=True, timeout=120)
                subprocess.run([cc, *self.link_flags, obj, "-o", tmp, *self.libs], check=True, capture_output=True,
                               text=True, timeout=120)
            finally:
                if os.path.exists(obj):
                    os.unlink(obj)
            os.replace(tmp, out)  # atomic: concurrent builders (engine cores, tests) never load half a file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def load(self) -> ctypes.CDLL | None:
        """The library, built on first use; None if it cannot be built here (logged once)."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            try:
                path, self.build = self.library_path(), "native"
                if not path.exists():
                    try:
                        self._build(path)
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        self.native_error = str(e)
                        prebuilt = self.prebuilt_path()
                        if prebuilt is None:
                            raise
                        path, self.build = prebuilt[1], f"{prebuilt[0]} (prebuilt)"
                lib = ctypes.CDLL(str(path))
                self.bind(lib)
                self._lib = lib
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or ""
                log.warning("%s unavailable (%s %s); %s", self.what, e, detail[-500:], self.fallback)
                self._lib, self.build, self.error = None, None, f"{e} {detail[-300:]}".strip()
            self._tried = True
        return self._lib

    def available(self) -> bool:
        return self.load() is not None


def kv_dtype_builds(source: Path, name: str, bind: Callable[[ctypes.CDLL], None], *, what: str,
                    fallback: str) -> dict:
    """A kernel reading KV pools, one build per pool dtype: ``{torch dtype: CKernel}`` for float32
    (``name``), bfloat16 (``-DKV_BF16``) and float16 (``-DKV_F16``); the source includes
    ``kv_elem.h`` (beside it), which widens each K / V element to float32 as it is read."""
    import torch

    headers = (source.with_name("kv_elem.h"),)
    return {
        torch.float32: CKernel(source, name, bind, what=what, fallback=fallback, headers=headers),
        torch.bfloat16: CKernel(source, name + "_bf16", bind, what=f"{what} (bfloat16 KV)", fallback=fallback,
                                flags=FAST_FLAGS + ("-DKV_BF16",), headers=headers),
        torch.float16: CKernel(source, name + "_f16", bind, what=f"{what} (float16 KV)", fallback=fallback,
                               flags=FAST_FLAGS + ("-DKV_F16",), headers=headers),
    }


def act_dtype_flags() -> dict:
    """``{torch dtype: extra compiler flags}`` of the activation dtypes the C kernels build for:
    float32 (none) and bfloat16 (``-DACT_BF16``: ``llm_svc/attention/act_elem.h``)."""
    import torch

    return {torch.float32: (), torch.bfloat16: ("-DACT_BF16",)}


def act_dtype_builds(source: Path, name: str, bind: Callable[[ctypes.CDLL], None], *, what: str, fallback: str,
                     flags: tuple[str, ...] = FAST_FLAGS, headers: tuple[Path, ...] = ()) -> dict:
    """A kernel over activations, one build per activation dtype: ``{torch dtype: CKernel}``, float32
    as ``name``, bfloat16 as ``name + "_abf16"`` (``-DACT_BF16``). The source includes
    ``act_elem.h`` (``llm_svc/attention/``, added to ``headers``): a bfloat16 build widens each
    row to float32 as it reads it and rounds its results back to bfloat16; its
    ``mmserve_act_path()`` names the conversion it compiled to (``act_path``)."""
    import torch

    headers = tuple(headers) + (Path(__file__).parents[1] / "attention" / "act_elem.h",)
    out = {}
    for dt, extra in act_dtype_flags().items():
        tag = "" if dt == torch.float32 else "_abf16"
        label = what if dt == torch.float32 else f"{what} (bfloat16 activations)"
        out[dt] = CKernel(source, name + tag, bind, what=label, fallback=fallback, flags=tuple(flags) + extra,
                          headers=headers)
    return out


def act_kv_dtype_builds(source: Path, name: str, bind: Callable[[ctypes.CDLL], None], *, what: str,
                        fallback: str) -> dict:
    """``kv_dtype_builds`` for each activation dtype: ``{(activation dtype, pool dtype): CKernel}``.
    The float32-activation builds are ``kv_dtype_builds``' own (same names, same flags)."""
    import torch

    headers = (source.with_name("kv_elem.h"), source.with_name("act_elem.h"))
    kv = {torch.float32: ("", ()), torch.bfloat16: ("_bf16", ("-DKV_BF16",)),
          torch.float16: ("_f16", ("-DKV_F16",))}
    out = {}
    for at, aflags in act_dtype_flags().items():
        atag = "" if at == torch.float32 else "_abf16"
        for kt, (ktag, kflags) in kv.items():
            label = what + ("" if kt == torch.float32 else f" ({str(kt).removeprefix('torch.')} KV)") + (
                "" if at == torch.float32 else " (bfloat16 activations)")
            out[(at, kt)] = CKernel(source, name + atag + ktag, bind, what=label, fallback=fallback,
                                    flags=FAST_FLAGS + kflags + aflags, headers=headers)
    return out


def act_path(kernel: CKernel) -> str | None:
    """The element type and conversion path a build took (``"float32"``, ``"bfloat16/avx512_bf16"``,
    ``"bfloat16/portable"``: ``act_elem.h``), or None when it is not built here."""
    lib = kernel.load()
    if lib is None:
        return None
    fn = lib.mmserve_act_path
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    return fn().decode()


_logged_paths: set[tuple[str, str]] = set()


def log_act_paths(families: dict[str, CKernel | None]) -> dict[str, str | None]:
    """One log line per kernel family naming the path its build took (``act_path``; None: no
    build, the family runs its torch fallback), once per process: where a CPU lacks the AVX-512
    BF16 instructions the bfloat16 builds say ``portable``. Returns ``{family: path}``."""
    out = {}
    for family, kernel in families.items():
        path = out[family] = None if kernel is None else act_path(kernel)
        if (family, str(path)) not in _logged_paths:
            _logged_paths.add((family, str(path)))
            log.info("%s kernels: %s", family, path or "none here, torch ops")
    return out


def kernel_report(kernels: list[CKernel] | None = None) -> dict:
    """Which build of each kernel loaded here (``native``, ``<level> (prebuilt)``) and which fell
    back to torch, with why: ``{"loaded": {name: build}, "fallback": {name: reason}}``. Loads
    (and where a compiler runs, builds) every kernel in ``kernels`` (default: every one defined)."""
    out: dict = {"loaded": {}, "fallback": {}}
    for k in REGISTRY if kernels is None else kernels:
        if k.load() is not None:
            out["loaded"][k.name] = k.build
            if k.native_error:
                out["native_unavailable"] = k.native_error  # one reason for all: no compiler, ...
        else:
            out["fallback"][k.name] = k.error or "not built"
    return out
