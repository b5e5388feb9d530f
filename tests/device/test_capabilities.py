"""keras_mp.device.capabilities: CPU flags, the cached micro-benchmark, and the rule that
picks the adaptive policy's default candidates."""

import pytest

from keras_mp.device import capabilities


def test_cpu_flags_parses_x86_and_arm_and_missing():
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n\nprocessor\t: 1\n"
    assert capabilities.cpu_flags(text) == {"fpu", "avx2", "amx_bf16", "avx512_bf16"}
    assert capabilities.cpu_flags("Features\t: fp asimd fphp\n") == {"fp", "asimd", "fphp"}
    assert capabilities.cpu_flags("model name : x\n") == frozenset()
    assert isinstance(capabilities.cpu_flags(), frozenset)
    with pytest.raises(TypeError, match="`cpuinfo`"):
        capabilities.cpu_flags(3)


def test_cpuinfo_is_read_in_one_place(monkeypatch, tmp_path):
    """What keras-mp knows of the CPU (capabilities' flags, XLA's matmul placement,
    the cache key, keras-mp info) is keras_mp.device._cpuinfo's reading."""
    from keras_mp.cli import command
    from keras_mp.device import _cpuinfo, cache, xla

    monkeypatch.delenv("KERAS_MP_CPU_CLASS", raising=False)  # this CPU's own reading
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    monkeypatch.setattr(_cpuinfo, "PATH", str(path))
    xla.cpu_has_bf16_matmul.cache_clear()
    try:
        assert _cpuinfo.fields()["model name"] == "Some CPU"
        assert capabilities.cpu_flags() == {"fpu", "avx2", "avx512_bf16"}
        assert xla.cpu_has_bf16_matmul() is True
        assert cache._cpu_lines() == ["Some CPU", "fpu avx2 avx512_bf16"]
        assert command._cpu_name() == "Some CPU"
        path.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
        xla.cpu_has_bf16_matmul.cache_clear()
        assert xla.cpu_has_bf16_matmul() is False
        monkeypatch.setattr(_cpuinfo, "PATH", str(tmp_path / "missing"))  # not Linux
        xla.cpu_has_bf16_matmul.cache_clear()
        assert _cpuinfo.fields() == {} and capabilities.cpu_flags() == frozenset()
        assert xla.cpu_has_bf16_matmul() is True  # TensorFlow's matmuls, never far off
        assert command._cpu_name()  # the platform's name
    finally:
        monkeypatch.undo()
        xla.cpu_has_bf16_matmul.cache_clear()


def test_a_cpu_class_is_decided_as_on_any_machine(monkeypatch, tmp_path):
    """KERAS_MP_CPU_CLASS: keras-mp reads the class's flags (its decisions), the
    CPU's name says so (the measurement cache keeps it apart), and keras-mp
    info and the bench say whose decisions on what hardware."""
    from keras_mp.device import _cpuinfo, cache

    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Big CPU\nflags\t\t: fpu avx2 avx512_bf16\n")
    monkeypatch.setattr(_cpuinfo, "PATH", str(path))
    monkeypatch.setenv("KERAS_MP_CPU_CLASS", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert _cpuinfo.fields()["model name"] == "Big CPU (decisions of class avx2)"
    assert not {"avx512_bf16", "amx_bf16"} & capabilities.cpu_flags()
    assert cache._cpu_lines()[0] == "Big CPU (decisions of class avx2)"
    assert _cpuinfo.describe() == ("decisions of class avx2 on Big CPU; kernels capped: "
                                   "ONEDNN_MAX_CPU_ISA=AVX2")
    assert _cpuinfo.kernel_caps("amx_bf16")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"
    monkeypatch.setenv("KERAS_MP_CPU_CLASS", "amx_bf16")
    assert "amx_bf16" in capabilities.cpu_flags()
    monkeypatch.setenv("KERAS_MP_CPU_CLASS", "pentium")
    with pytest.raises(ValueError, match="KERAS_MP_CPU_CLASS must be one of"):
        _cpuinfo.fields()
    with pytest.raises(ValueError, match="`name`"):
        _cpuinfo.kernel_caps("pentium")
    monkeypatch.delenv("KERAS_MP_CPU_CLASS")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert _cpuinfo.describe().startswith("decisions of this CPU on Big CPU; kernels uncapped")


def test_judge_needs_hardware_and_a_measurement_that_agrees():
    fast = {"float32": 1.0, "bfloat16": 3.0, "float16": 2.0}
    assert capabilities._judge({"bfloat16": True, "float16": True}, fast) == ("bfloat16", "float16")
    # A flag whose measurement disagrees (no kernel, emulation) does not count...
    assert capabilities._judge({"bfloat16": True, "float16": True},
                         {"float32": 1.0, "bfloat16": 0.5, "float16": 0.0}) == ()
    # ...nor does a good measurement without hardware support (noise, tiny matmul).
    assert capabilities._judge({"bfloat16": False, "float16": False}, fast) == ()


def test_profile_is_measured_once_and_cached():
    p = capabilities.profile("CPU")
    assert p is capabilities.profile("CPU")
    assert p.device_type == "CPU"
    assert p.throughput["float32"] > 0
    assert set(p.throughput) == {"float32", "bfloat16", "float16"}
    assert p.speedup("float32") == pytest.approx(1.0)
    again = capabilities.profile("CPU", refresh=True, size=64, repeats=1)
    assert again is not p and again is capabilities.profile("CPU")


def test_no_float16_on_a_cpu_without_float16_units():
    p = capabilities.profile("CPU")
    has_fp16_units = bool(p.flags & {"amx_fp16", "avx512_fp16"})
    assert p.hardware["float16"] == has_fp16_units
    if not has_fp16_units:
        assert "float16" not in capabilities.fast_dtypes("CPU")
        assert "float16" not in capabilities.default_candidates("CPU")
    has_bf16_units = bool(p.flags & {"amx_bf16", "avx512_bf16"})
    assert ("bfloat16" in capabilities.default_candidates("CPU")) == (
        has_bf16_units and p.speedup("bfloat16") >= 0.9)


def test_default_candidates_end_in_float32_and_prefer_bfloat16():
    c = capabilities.default_candidates()
    assert c[-1] == "float32" and len(c) <= 2
    if "bfloat16" in capabilities.fast_dtypes():
        assert c == ("bfloat16", "float32")


@pytest.mark.parametrize("kwargs, name", [
    ({"device_type": "XPU"}, "device_type"), ({"size": 8}, "size"), ({"repeats": 0}, "repeats"),
])
def test_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        capabilities.profile(**kwargs)



def test_a_measurement_that_contradicts_the_hardware_is_repeated(monkeypatch):
    # Noise once made bfloat16 measure 0.6x float32 on a CPU where it is
    # 1.2x, and a whole process trained in float32.
    runs = iter([{"float32": 10.0, "bfloat16": 6.0, "float16": 0.5},
                 {"float32": 9.0, "bfloat16": 12.0, "float16": 0.4}])
    calls = []

    def measure(device_type, n, repeats):
        calls.append(n)
        return next(runs)

    monkeypatch.setattr(capabilities, "_cache", {})  # the real profile comes back after
    monkeypatch.setattr(capabilities, "_measure", measure)
    monkeypatch.setattr(capabilities, "_hardware",
                        lambda device_type, flags: {"bfloat16": True, "float16": False,
                                                    "float8": False})
    p = capabilities.profile("CPU", refresh=True)
    assert p.fast == ("bfloat16",) and len(calls) == 2
    assert p.throughput == {"float32": 10.0, "bfloat16": 12.0, "float16": 0.5}
    # A dtype the hardware supports but that always measures slow (emulated,
    # no kernel) stays out, after the repeats.
    calls.clear()
    monkeypatch.setattr(capabilities, "_hardware",
                        lambda device_type, flags: {"bfloat16": True, "float16": True,
                                                    "float8": False})
    monkeypatch.setattr(capabilities, "_measure", lambda device_type, n, repeats: calls.append(n)
                        or {"float32": 10.0, "bfloat16": 12.0, "float16": 1.0})
    p = capabilities.profile("CPU", refresh=True)
    assert p.fast == ("bfloat16",) and len(calls) == 1 + capabilities._REMEASURE
