"""Model FLOPs utilisation, one method for every GPU benchmark (``trainer_throughput.py``,
``megatron_tp.py``, ``recompute.py``).

MFU is the model FLOPs of the steps per second (``training.reference_decoder.DecoderShape.
train_flops_per_token``: recomputation is not useful work) over the datasheet dense bf16 peak of the
GPUs they ran on (:data:`DENSE_BF16_PEAK_TFLOPS`; 989 TFLOP/s for an H200 SXM), so a figure compares
across machines and with published ones. Beside it each benchmark prints the bf16 matmul rate it
measured in the same run (:func:`matmul_tflops`, an 8192³ product after a warm-up): what this GPU
sustains on its best kernel today (647 to 789 TFLOP/s on the H200s measured so far), and the share of
that rate the step reached.

Figures recorded before this module divided by that measured rate; the MFU against the datasheet is
the old figure times ``measured / 989``.
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's datasheets; the first entry
# whose name is in the device's name applies, so the more specific names come first.
DENSE_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name()``), or None
    for a device the table does not know (a CPU, another GPU: MFU is then not given)."""
    for name, tflops in DENSE_BF16_PEAK_TFLOPS:
        if name in device_name:
            return tflops
    return None


def device_peak_tflops(device: str) -> tuple[str, float | None]:
    """``(device name, datasheet dense bf16 peak)`` of this process's current device."""
    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, datasheet_peak_tflops(name)


def matmul_tflops(n: int = 8192, reps: int = 20, warmup_s: float = 2.0, device: str = "cuda") -> float:
    """The median rate of an n×n×n bf16 matmul on random data, in TFLOP/s (5 products a sample),
    after ``warmup_s`` seconds of the same products (a cold GPU runs below its clocks for a while)."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync()
    t_end = time.perf_counter() + (warmup_s if device == "cuda" else 0.0)
    for _ in range(5):
        a @ b
    while time.perf_counter() < t_end:
        for _ in range(10):
            a @ b
        sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        sync()
        times.append((time.perf_counter() - t0) / 5)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def mfu(model_tflops: float, peak_tflops: float | None, gpus: int = 1) -> float | None:
    """Model FLOPs utilisation: ``model_tflops`` (model FLOPs per second of the step, all GPUs) over
    ``gpus`` times the datasheet peak; None where the peak is not known."""
    return None if peak_tflops is None else model_tflops / (peak_tflops * gpus)


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def mfu_header(peak_tflops: float | None) -> str:
    """The MFU column's heading, naming the peak it is of."""
    return f"MFU (of {peak_tflops:.0f} TFLOP/s datasheet)" if peak_tflops else "MFU (no datasheet peak)"


def describe(device_name: str, peak_tflops: float | None, matmul: float) -> str:
    """The line a benchmark prints once: the peak its MFU is of, and the matmul rate measured."""
    datasheet = (f"MFU is of the datasheet dense bf16 peak of the {device_name}, {peak_tflops:.0f} TFLOP/s a GPU"
                 if peak_tflops else f"no datasheet bf16 peak known for {device_name}: MFU not given")
    share = f" ({matmul / peak_tflops:.0%} of it)" if peak_tflops else ""
    return f"{datasheet}; bf16 matmul measured in this run: {matmul:.3g} TFLOP/s{share}"
