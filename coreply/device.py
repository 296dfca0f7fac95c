"""The one place where the compute device is chosen.

torch is imported by the functions that use it, not here: the service's settings check a device's name
(:func:`check_device_name`) before anything else loads, and a refused setting is said in a fraction of a
second instead of after torch's two.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def check_device_name(preference: str) -> str:
    """``preference`` if it names a device coreply can use (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else a
    ValueError that lists them. Says nothing about this host (:func:`resolve_device` does)."""
    kind, _, index = preference.partition(":")
    if preference != "auto" and (
        kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit()))
    ):
        raise ValueError(f"device {preference!r} is not one of auto, cpu, cuda, cuda:N")
    return preference


def resolve_device(preference: str = "auto") -> torch.device:
    """Map ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` to a device; ``auto`` takes CUDA when present.
    Anything else, or CUDA this host lacks, is a ValueError that says what to use instead."""
    import torch

    if check_device_name(preference) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if preference.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {preference!r} asked for, but this host has no CUDA: use cpu or auto")
    device = torch.device(preference)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {preference!r}: this host has {torch.cuda.device_count()} CUDA devices")
    return device


def set_threads(threads: int) -> None:
    """This process's compute threads: torch's intra-op pool. numpy's BLAS is held to one thread (a CPU's
    exact search spreads its matmul over threads of its own): OpenBLAS starts one per core, and its idle
    threads spin on the cores the next stage needs (docs/performance.md section 15)."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(1, user_api="blas")


def one_openmp_thread() -> None:
    """Run torch's parallel kernels on the calling thread alone from now on (a thread pool's
    ``initializer``). A thread that runs parallel work otherwise gets a team of OpenMP workers of its own,
    and they spin for milliseconds after each kernel (section 11 of docs/performance.md; section 16: the
    exact search's helpers). Only this thread changes: OpenMP's thread count is per thread."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.get_num_threads()  # torch sets a new thread's OpenMP threads on its first use: that first, then 1
    threadpool_limits(1, user_api="openmp")


def autocast(device: torch.device, cpu_bf16: bool = False):
    """bf16 autocast on CUDA; on a CPU a no-op (fp32) unless ``cpu_bf16``."""
    import torch

    on = device.type == "cuda" or (device.type == "cpu" and cpu_bf16)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on)


def _cpu_supports(*features: str) -> bool:
    """Whether torch finds any of these CPU features (``torch.cpu._is_<feature>_supported``; a torch
    without the probe counts as not)."""
    import torch

    probes = (getattr(torch.cpu, f"_is_{feature}_supported", None) for feature in features)
    return any(probe is not None and probe() for probe in probes)


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX-512 BF16, or AMX tiles): there a bf16 matmul
    of a block of queries against the pool runs about three times faster than float32's (the exact
    search's first pass, docs/performance.md §16), and a model cast to bf16 stays much closer to fp32
    than the int8 ONNX graphs: with AMX it beats them on large batches (docs/performance.md §10); with
    AVX-512 BF16 alone it is 1.8 times faster than fp32 and 1.4 times slower than int8 (docs/results.md
    §40.5). Elsewhere bf16 is emulated and slow."""
    return _cpu_supports("avx512_bf16", "amx_tile")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles. On such a host (an Intel Xeon with a 480 MB L3) the exact search's
    low-precision first pass pays for a lone query only while the pool sits in cache: as served,
    between the encoders and the reranker, one float32 pass is faster (docs/performance.md §27)."""
    return _cpu_supports("amx_tile")


def batch_scale(device: torch.device) -> int:
    """How many times larger an inference batch is on a GPU than on a CPU. At CPU sizes (4,096 padded
    tokens) an H100's time per batch is mostly launches and a host sync: validation scored pairs at about
    a fifth of the rate training trains them (docs/results.md section 18)."""
    return 16 if device.type == "cuda" else 1


def on_own_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` run on a new thread that ends when it returns; its result, or its exception raised.

    PyTorch's OpenMP gives every thread that runs parallel work its own team of worker threads, kept until
    that thread ends. Once the teams hold more threads than the host has cores, libgomp stops spinning
    between parallel regions and each one waits for its workers to wake: on 2 vCPUs a context's encoding
    served in 19 ms instead of 8 (docs/performance.md §11). One-off work (building a bundle, loading and
    timing an engine) runs here so that the serving threads' teams are the only ones left."""
    with ThreadPoolExecutor(1, thread_name_prefix="coreply-once") as once:
        return once.submit(fn, *args).result()
