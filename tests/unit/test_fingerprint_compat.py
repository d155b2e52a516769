import copy
import json
import subprocess
import sys

from tests.conftest import tiny_recipe
from warmer import compat, fingerprint

SMI_H200 = "NVIDIA H200, 9.0, 143771, 570.124.06\nNVIDIA H200, 9.0, 143771, 570.124.06\n"
SMI_HEADER = "| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: 12.8 |"


def test_probe_describes_this_machine():
    fp = fingerprint.probe()
    assert fp["machine"] and fp["python"].count(".") == 2
    assert fp["cpu"]["threads"] >= 1
    assert fp["paths"]["python_prefix"] == sys.prefix
    assert "torch" in fp["packages"]  # the test environment has the CPU extra
    json.dumps(fp)


def test_node_path_imports_neither_torch_nor_vllm():
    code = ("import sys, warmer.cli, warmer.fetch, warmer.restore; from warmer import fingerprint; "
            "fingerprint.probe(); print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_nvidia_smi_fallback_parses():
    gpu = fingerprint.parse_nvidia_smi(SMI_H200, SMI_HEADER)
    assert [d["name"] for d in gpu["gpus"]] == ["NVIDIA H200"] * 2
    assert gpu["gpus"][0]["compute_capability"] == "9.0"
    assert gpu["driver"] == "570.124.06" and gpu["cuda_driver"] == "12.8"


def _gpu_node(name="NVIDIA H200", cc="9.0", driver="570.124.06"):
    fp = fingerprint.probe()
    fp["gpu"] = {"count": 1, "devices": [{"name": name, "compute_capability": cc, "memory_mib": 143771}],
                 "driver": driver, "cuda_driver": "12.8", "source": "nvml"}
    return fp


def test_key_is_stable_and_follows_hard_fields():
    r = tiny_recipe().identity()
    h200 = _gpu_node()
    assert compat.key(h200, r) == compat.key(copy.deepcopy(h200), r)
    assert compat.key(_gpu_node("NVIDIA H100 80GB HBM3"), r) != compat.key(h200, r)
    assert compat.key(h200, tiny_recipe(max_num_seqs=2).identity()) != compat.key(h200, r)
    # A newer driver is not a different artifact: it is a ranged field.
    assert compat.key(_gpu_node(driver="580.1"), r) == compat.key(h200, r)


def test_cpu_isa_and_threads_are_hard_on_cpu_hosts():
    r = tiny_recipe().identity()
    node = fingerprint.probe()
    node["gpu"]["devices"] = []
    avx2 = copy.deepcopy(node)
    avx2["cpu"]["isa"] = ["avx", "avx2", "fma"]
    assert compat.key(avx2, r) != compat.key(node, r)
    more = copy.deepcopy(node)
    more["cpu"]["threads"] = node["cpu"]["threads"] + 14
    assert compat.key(more, r) != compat.key(node, r)
    failed = {d.field for d in compat.check(node, avx2) if not d.ok}
    assert failed == {"cpu.isa"}


def test_driver_range():
    built = _gpu_node(driver="570.124.06")
    assert compat.fits(compat.check(built, _gpu_node(driver="575.51.03")))
    older = compat.check(built, _gpu_node(driver="550.54.15"))
    assert not compat.fits(older)
    bad = [d for d in older if not d.ok]
    assert [d.field for d in bad] == ["gpu.driver"] and "older" in bad[0].reason
