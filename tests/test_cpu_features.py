"""The CPU's default dtype: bfloat16 where the CPU has bfloat16 instructions or AVX2 with FMA and
F16C (the C tile kernels), else float32."""

from __future__ import annotations

import torch

from engine.cpu_features import avx2_tiles, cpu_default_dtype, native_bf16
from engine.devices import resolve_dtype
from engine.engine_config import EngineConfig

ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw "
        "avx512_bf16 avx512_vnni\n\n")
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 fma f16c avx2 avx512f avx512bw avx512vl avx512dq\n\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx512f avx512bw amx_tile amx_bf16 amx_int8\n"
ZEN2 = "processor\t: 0\nflags\t\t: fpu sse2 fma f16c avx2 bmi2 sha_ni\n\n"
SANDY_BRIDGE = "flags\t\t: fpu sse2 avx\n"


def _cpuinfo(tmp_path, text: str):
    path = tmp_path / f"cpuinfo{abs(hash(text))}"
    path.write_text(text)
    return path


def test_bf16_instructions_are_read_from_cpuinfo(tmp_path):
    def native(text: str) -> bool:
        return native_bf16(_cpuinfo(tmp_path, text))

    assert native(ZEN4) and native(SAPPHIRE_RAPIDS)
    # Plain AVX512: oneDNN emulates bfloat16 there, slower than float32, so it does not count.
    assert not native(SKYLAKE) and not native(ZEN2)
    assert not native("processor\t: 0\n")  # no flags line (an emulator, another OS's format)
    assert not native_bf16(tmp_path / "absent")


def test_auto_is_bfloat16_where_the_tile_kernels_have_their_instructions(tmp_path):
    def default(text: str) -> str:
        return cpu_default_dtype(_cpuinfo(tmp_path, text))

    assert default(ZEN4) == default(SAPPHIRE_RAPIDS) == "bfloat16"
    # AVX2 with FMA and F16C: the tile kernels' AVX2 build multiplies bfloat16 in float32.
    assert default(ZEN2) == default(SKYLAKE) == "bfloat16"
    assert avx2_tiles(_cpuinfo(tmp_path, ZEN2)) and not avx2_tiles(_cpuinfo(tmp_path, ZEN4))
    # Without AVX2 (or without any flags to read), float32.
    assert default(SANDY_BRIDGE) == default("processor\t: 0\n") == "float32"
    assert cpu_default_dtype(tmp_path / "absent") == "float32"


def test_auto_follows_the_cpu_the_same_way_with_and_without_torch():
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if cpu_default_dtype() == "bfloat16" else torch.float32
    assert resolve_dtype(None, cpu) == expected
    assert EngineConfig("any").concrete_dtype("cpu") == str(expected).removeprefix("torch.")
    # An explicit dtype is never changed.
    assert resolve_dtype("float32", cpu) == torch.float32
    assert EngineConfig("any", dtype="float32").concrete_dtype("cpu") == "float32"
