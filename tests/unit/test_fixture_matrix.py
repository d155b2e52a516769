"""The fingerprint matrix: GPU SKUs and CPU hosts that must not share an artifact, and pairs that may.

NVML cannot run on this machine (no GPU, no driver): recorded NVML answers per SKU stand in for it,
fed to the real reader (fingerprint.read_nvml) through a fake binding, and recorded nvidia-smi output
in its real formats goes through the real parser. Both must describe each SKU the same way. Where the
SKU names and numbers come from, and which are uncertain: tests/fixtures/README.md.
"""

import itertools
import os
import sys

import pytest

from tests.conftest import tiny_recipe
from tests.fixtures import nodes
from warmer import compat, fingerprint

RECIPE = tiny_recipe().identity()
# (name, compute capability, FlashInfer arch with CUDA 12.9) as NVML reports them.
EXPECTED = {
    "h100-sxm": ("NVIDIA H100 80GB HBM3", "9.0", "90a"),
    "h100-pcie": ("NVIDIA H100 PCIe", "9.0", "90a"),
    "h200": ("NVIDIA H200", "9.0", "90a"),
    "b200": ("NVIDIA B200", "10.0", "100a"),
    "gb200": ("NVIDIA GB200", "10.0", "100a"),
    "rtx-5090": ("NVIDIA GeForce RTX 5090", "12.0", "120f"),
    "rtx-pro-6000": ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0", "120f"),
    "rtx-pro-6000-server": ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "12.0", "120f"),
    "l40s": ("NVIDIA L40S", "8.9", "89"),
    "a100": ("NVIDIA A100-SXM4-80GB", "8.0", "80"),
}


def failed(built, node, recipe: dict = RECIPE) -> dict[str, str]:
    return {d.field: d.reason for d in compat.decisions(built, node, recipe) if not d.ok}


def test_every_sku_has_fixtures():
    assert sorted(EXPECTED) == nodes.GPU_SKUS


@pytest.mark.parametrize("sku", sorted(EXPECTED))
def test_nvml_and_nvidia_smi_describe_each_sku_alike(sku):
    by_nvml, by_smi = nodes.gpu_node(sku).gpu.to_json(), nodes.gpu_node(sku, via="nvidia-smi").gpu.to_json()
    assert (by_nvml["name"], by_nvml["compute_capability"], by_nvml["arch"]) == EXPECTED[sku]
    assert by_nvml["count"] == len(nodes.gpu_fixture(sku)["nvml"]["devices"]) and not by_nvml["mixed"]
    assert by_nvml["driver"] == nodes.gpu_fixture(sku)["nvml"]["nvmlSystemGetDriverVersion"]
    assert by_nvml["source"] == "nvml" and by_smi["source"] == "nvidia-smi"
    assert {**by_nvml, "source": None} == {**by_smi, "source": None}
    assert not any("uuid" in d for d in by_nvml["devices"])  # per-board ids stay out of the fingerprint


def test_old_nvml_bindings_answer_bytes():
    recorded = nodes.gpu_fixture("h200")["nvml"]
    fake = nodes.FakeNVML(recorded, as_bytes=True)
    got = fingerprint.read_nvml(fake)
    assert got["devices"][0]["name"] == "NVIDIA H200" and got["driver"] == "570.133.20"
    assert got["cuda_driver"] == "12.8" and fake.initialised == 0  # shut down again


@pytest.mark.parametrize("a,b", list(itertools.combinations(sorted(EXPECTED), 2)))
def test_different_gpu_types_never_share(a, b):
    na, nb = nodes.gpu_node(a), nodes.gpu_node(b)
    assert compat.key(na, RECIPE) != compat.key(nb, RECIPE)
    for built, node in ((na, nb), (nb, na)):
        reasons = failed(built, node)
        # Inductor keys on the name, so even same-arch SKUs (H100 SXM / PCIe / H200, 5090 / PRO 6000) differ.
        assert "gpu.name" in reasons, reasons
        assert EXPECTED[a][0] in reasons["gpu.name"] and EXPECTED[b][0] in reasons["gpu.name"]
        if EXPECTED[a][1] != EXPECTED[b][1]:
            assert {"gpu.compute_capability", "gpu.arch"} <= set(reasons)


@pytest.mark.parametrize("sku", sorted(EXPECTED))
def test_same_gpu_with_a_newer_driver_shares(sku):
    built = nodes.gpu_node(sku)
    major = int(built.gpu.driver.split(".")[0])
    node = nodes.edit(built, **{"gpu.driver": f"{major + 10}.20.01", "gpu.cuda_driver": "13.9"})
    if built.machine == "x86_64":  # another host CPU
        node = nodes.edit(node, cpu=nodes.cpu_section("amd-genoa"))
    assert compat.key(node, RECIPE) == compat.key(built, RECIPE)
    assert failed(built, node) == {}
    # The other way round, the node's driver is older than the build's: same key, refused.
    reasons = failed(node, built)
    assert set(reasons) == {"gpu.driver", "gpu.cuda_driver"} and "older" in reasons["gpu.driver"]


def test_fewer_gpus_share_unless_the_recipe_needs_more():
    built, node = nodes.gpu_node("h200"), nodes.gpu_node("h200")
    node = nodes.edit(node, **{"gpu.devices": node.gpu.to_json()["devices"][:4], "gpu.count": 4})
    assert compat.key(node, RECIPE) == compat.key(built, RECIPE) and failed(built, node) == {}
    tp8 = tiny_recipe(tensor_parallel_size=8).identity()
    reasons = failed(built, node, tp8)
    assert set(reasons) == {"gpu.count"} and "needs 8" in reasons["gpu.count"]


def test_rtx_5090_with_and_without_nvcc_129_gets_another_flashinfer_arch():
    with_nvcc = nodes.gpu_node("rtx-5090", torch_cuda="12.8", nvcc="12.9")
    torch_only = nodes.gpu_node("rtx-5090", torch_cuda="12.8", nvcc=None)
    assert (with_nvcc.gpu.arch, torch_only.gpu.arch) == ("120f", "120a")
    assert compat.key(with_nvcc, RECIPE) != compat.key(torch_only, RECIPE)
    assert {"gpu.arch", "nvcc"} <= set(failed(with_nvcc, torch_only))


def test_flashinfer_arch_tags():
    arch = fingerprint.flashinfer_arch
    assert arch(["9.0"], "12.8") == "90a" and arch(["10.0"], "12.8") == "100a" and arch(["10.3"], "12.9") == "103a"
    assert arch(["12.0"], "12.9") == "120f" and arch(["12.0"], "12.8") == "120a" and arch(["12.1"], "13.0") == "121a"
    assert arch(["8.0"], None) == "80" and arch(["8.9", "9.0"], "12.8") == "89_90a" and arch([None], "12.8") is None


def test_a_node_whose_gpus_differ_gets_no_artifact_and_says_why():
    fx = nodes.gpu_fixture("mixed-h100-l40s")
    gpu = fingerprint.gpu_section(fingerprint.read_nvml(nodes.FakeNVML(fx["nvml"])), "12.9", None, [])
    mixed = nodes.gpu_node("h100-pcie").with_gpus(gpu)
    assert gpu.mixed and gpu.name is None and gpu.arch == "89_90a"
    [problem] = compat.unfit_reasons(mixed)
    assert "NVIDIA H100 PCIe" in problem and "NVIDIA L40S" in problem and "CUDA_VISIBLE_DEVICES" in problem
    for sku in ("h100-pcie", "l40s"):
        reasons = failed(nodes.gpu_node(sku), mixed)
        assert "gpu.mixed" in reasons and "differ" in reasons["gpu.mixed"]
    # nvidia-smi says the same.
    smi = fingerprint.gpu_section(fingerprint.parse_nvidia_smi(*nodes.smi_fixture("mixed-h100-l40s")), "12.9", None, [])
    assert smi.mixed and {d.name for d in smi.devices} == {"NVIDIA H100 PCIe", "NVIDIA L40S"}


def test_cuda_visible_devices_narrows_a_mixed_node_to_one_type():
    recorded = fingerprint.read_nvml(nodes.FakeNVML(nodes.gpu_fixture("mixed-h100-l40s")["nvml"]))
    uuid_l40s = recorded["devices"][2]["uuid"]
    by_index = fingerprint.gpu_section(recorded, "12.9", "0,1", [])
    by_uuid = fingerprint.gpu_section(recorded, "12.9", uuid_l40s[:12], [])
    assert (by_index.name, by_index.count, by_index.mixed) == ("NVIDIA H100 PCIe", 2, False)
    assert (by_uuid.name, by_uuid.count) == ("NVIDIA L40S", 1)
    assert fingerprint.gpu_section(recorded, "12.9", "", []).count == 0
    assert fingerprint.gpu_section(recorded, "12.9", "1,7,2", []).count == 1  # CUDA stops at an unknown entry
    assert fingerprint.gpu_section(recorded, "12.9", "MIG-0c1d2e3f-aaaa", []).count == 4  # whole GPUs described


def test_indices_on_a_mixed_node_in_cudas_own_order_are_no_fit():
    """CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID (vLLM warns of it): on a
    node of two H100s and two L40S, CUDA_VISIBLE_DEVICES=0 is an H100 to vLLM where NVML's index 0 is
    whatever sits first on the bus. warmer took NVML's, and fetched (or published) the other GPU's
    kernels. Unless the order is PCI's or the GPUs are named by UUID, such a node is mixed: no fit."""
    recorded = fingerprint.read_nvml(nodes.FakeNVML(nodes.gpu_fixture("mixed-h100-l40s")["nvml"]))
    notes: list[str] = []
    fastest_first = fingerprint.gpu_section(recorded, "12.9", "0", notes, pci_order=False)
    assert fastest_first.mixed and fastest_first.count == 4 and "CUDA_DEVICE_ORDER" in " ".join(notes)
    [problem] = compat.unfit_reasons(nodes.gpu_node("h100-pcie").with_gpus(fastest_first))
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in problem
    pci = fingerprint.gpu_section(recorded, "12.9", "0", [], pci_order=True)
    assert (pci.name, pci.count, pci.mixed) == ("NVIDIA H100 PCIe", 1, False)
    uuid = fingerprint.gpu_section(recorded, "12.9", recorded["devices"][2]["uuid"], [], pci_order=False)
    assert (uuid.name, uuid.mixed) == ("NVIDIA L40S", False)  # a UUID names one board in any order
    one_type = fingerprint.read_nvml(nodes.FakeNVML(nodes.gpu_fixture("h100-pcie")["nvml"]))
    assert not fingerprint.gpu_section(one_type, "12.9", "0", [], pci_order=False).mixed  # all alike: no doubt


# nvidia-smi prints these formats too; warmer must read them all.
SMI_WITH_HEADER = """index, name, compute_cap, memory.total [MiB], driver_version, pci.device_id, uuid
0, NVIDIA H100 80GB HBM3, 9.0, 81559 MiB, 570.124.06, 0x233010DE, GPU-1d2c3b4a-0000-1111-2222-333344445555
"""
SMI_OLD_DRIVER = "0, NVIDIA A100-SXM4-80GB, [N/A], 81920, 470.256.02, 0x20B210DE, [N/A]\n"
SMI_Q = """
==============NVSMI LOG==============

Timestamp                                 : Thu Oct  9 10:12:03 2025
Driver Version                            : 580.65.06
CUDA Version                              : 13.0

Attached GPUs                             : 4
"""


def test_nvidia_smi_formats():
    with_header = fingerprint.parse_nvidia_smi(SMI_WITH_HEADER, SMI_Q)
    assert with_header["devices"][0]["memory_mib"] == 81559 and with_header["devices"][0]["pci_device_id"] == "0x2330"
    assert with_header["cuda_driver"] == "13.0" and with_header["driver"] == "570.124.06"
    old = fingerprint.parse_nvidia_smi(SMI_OLD_DRIVER, "")
    assert old["devices"][0]["compute_capability"] is None and old["devices"][0]["uuid"] is None
    assert fingerprint.gpu_section(old, "12.2", None, []).arch is None  # unknown, never guessed
    # Driver 610's banner says "KMD Version" and "CUDA UMD Version".
    r610 = fingerprint.parse_nvidia_smi("", nodes.smi_fixture("rtx-pro-6000")[1])
    assert (r610["driver"], r610["cuda_driver"]) == ("610.43.02", "13.3")


def test_probe_reads_a_fake_nvidia_smi_when_nvml_fails(monkeypatch, tmp_path):
    """The real probe, with NVML failing (driver/library mismatch) and nvidia-smi on PATH."""
    csv, banner = nodes.smi_fixture("h100-pcie")
    (tmp_path / "query.csv").write_text(csv)
    (tmp_path / "banner.txt").write_text(banner)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$1" in --query-gpu=*) cat {tmp_path}/query.csv;;\n'
                   f'*) cat {tmp_path}/banner.txt;; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml",
                        nodes.FakeNVML({}, fail="Driver/library version mismatch"))
    gpu = fingerprint.probe().gpu.to_json()
    assert (gpu["source"], gpu["name"], gpu["count"]) == ("nvidia-smi", "NVIDIA H100 PCIe", 2)
    assert gpu["cuda_driver"] == "12.8"  # from the banner
    assert gpu["notes"] == ["NVML: Driver/library version mismatch"]


def test_probe_survives_nvidia_smi_output_it_cannot_read(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'index, serial'\necho '0, 1320921012345'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", nodes.FakeNVML({}, fail="NVML Shared Library Not Found"))
    gpu = fingerprint.probe().gpu.to_json()
    assert gpu["count"] == 0 and "unreadable output" in gpu["notes"][1]


def test_probe_reads_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", nodes.FakeNVML(nodes.gpu_fixture("b200")["nvml"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    gpu = fingerprint.probe().gpu.to_json()
    assert (gpu["source"], gpu["name"], gpu["count"], gpu["driver"]) == ("nvml", "NVIDIA B200", 4, "575.57.08")
    assert gpu["arch"] == "100a" and gpu["visible_devices"] == "0,1,2,3"


# CPU hosts: Inductor's CPU cache does not key on the ISA, so warmer must.
AVX512 = ("intel-sapphire-rapids", "amd-genoa")
AVX2 = ("intel-broadwell", "amd-milan")


@pytest.mark.parametrize("a,b", list(itertools.combinations(nodes.CPU_HOSTS, 2)))
def test_different_cpu_hosts_never_share(a, b):
    na, nb = nodes.cpu_node(a), nodes.cpu_node(b)
    assert compat.key(na, RECIPE) != compat.key(nb, RECIPE)
    for (built, n_built), (node, n_node) in (((a, na), (b, nb)), ((b, nb), (a, na))):
        reasons = failed(n_built, n_node)
        assert "cpu.isa" in reasons or "machine" in reasons, reasons
        if built in AVX512 and node in AVX2:  # would compute wrong numbers
            assert "missing on this node: " in reasons["cpu.isa"] and "avx512f" in reasons["cpu.isa"]
        if built in AVX2 and node in AVX512:  # would crash
            assert "only on this node: " in reasons["cpu.isa"] and "avx512f" in reasons["cpu.isa"]


def test_cpu_isa_decides_on_cpu_hosts_and_the_thread_count_does_not():
    avx512, avx2 = nodes.cpu_node("amd-genoa"), nodes.cpu_node("amd-milan")
    assert {"cpu.isa"} == set(failed(avx512, avx2))  # nothing else differs between the two
    # The same CPU under another model name, with a newer glibc: shares.
    other = nodes.edit(avx512, **{"cpu.model": "AMD EPYC 9554 64-Core Processor", "glibc": "2.39"})
    assert compat.key(other, RECIPE) == compat.key(avx512, RECIPE) and failed(avx512, other) == {}
    # vLLM compiles with cpp.dynamic_threads, which leaves the thread count out of Inductor's key:
    # a pod given other CPUs than the builder shares the artifact.
    more = nodes.cpu_node("amd-genoa", env={"OMP_NUM_THREADS": "16"})
    assert more.cpu.threads == 16
    assert compat.key(more, RECIPE) == compat.key(avx512, RECIPE) and failed(avx512, more) == {}
    # An older glibc than the build's is refused.
    assert set(failed(other, avx512)) == {"glibc"}
    # ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 host compile AVX2 kernels: another artifact.
    forced = nodes.cpu_node("amd-genoa", env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert set(failed(avx512, forced)) == {"cpu.aten_capability"}


def test_thread_count_is_physical_cores_of_the_affinity():
    cores = fingerprint.parse_cpuinfo(nodes.cpuinfo("intel-sapphire-rapids"))["cores"]
    assert fingerprint.cpu_threads(cores, {0, 1, 2, 3}, {}) == 2  # two cores, two hyperthreads each
    assert fingerprint.cpu_threads(cores, {0, 2}, {}) == 1
    assert fingerprint.cpu_threads(cores, {0, 1, 2, 3}, {"MKL_NUM_THREADS": "3"}) == 3


def test_on_gpu_nodes_the_host_cpu_is_advisory():
    sxm = nodes.gpu_node("h100-sxm")
    on_amd = nodes.edit(sxm, cpu=nodes.cpu_section("amd-milan"))
    assert compat.key(on_amd, RECIPE) == compat.key(sxm, RECIPE)
    advisory = {d.field for d in compat.decisions(sxm, on_amd) if d.kind == compat.ADVISORY and d.built != d.node}
    assert {"cpu.isa", "cpu.model"} <= advisory


def _all_nodes():
    out = {f"gpu:{s}": nodes.gpu_node(s) for s in EXPECTED}
    out.update({f"cpu:{h}": nodes.cpu_node(h) for h in nodes.CPU_HOSTS})
    out["gpu:h200-new-driver"] = nodes.edit(out["gpu:h200"], **{"gpu.driver": "580.65.06"})
    return out


def test_key_and_check_agree_on_every_pair():
    """One lookup is enough: two fingerprints pass every hard rule exactly when their keys are equal."""
    everything = _all_nodes()
    for (na, a), (nb, b) in itertools.product(everything.items(), repeat=2):
        hard_ok = not any(d.kind == compat.HARD and not d.ok for d in compat.decisions(a, b, RECIPE))
        assert hard_ok == (compat.key(a, RECIPE) == compat.key(b, RECIPE)), (na, nb)
