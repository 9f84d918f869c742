"""The CPU's default dtype: bfloat16 where the CPU has bfloat16 instructions, else float32."""

from __future__ import annotations

import torch

from engine.cpu_features import native_bf16
from engine.devices import resolve_dtype
from engine.engine_config import EngineConfig

ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw "
        "avx512_bf16 avx512_vnni\n\n")
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512dq\n\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx512f avx512bw amx_tile amx_bf16 amx_int8\n"


def test_bf16_instructions_are_read_from_cpuinfo(tmp_path):
    def native(text: str) -> bool:
        path = tmp_path / f"cpuinfo{hash(text)}"
        path.write_text(text)
        return native_bf16.__wrapped__(path)

    assert native(ZEN4) and native(SAPPHIRE_RAPIDS)
    # Plain AVX512: oneDNN emulates bfloat16 there, slower than float32, so it does not count.
    assert not native(SKYLAKE)
    assert not native("processor\t: 0\n")  # no flags line (an emulator, another OS's format)
    assert not native_bf16.__wrapped__(tmp_path / "absent")


def test_auto_follows_the_cpu_the_same_way_with_and_without_torch():
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if native_bf16() else torch.float32
    assert resolve_dtype(None, cpu) == expected
    assert EngineConfig("any").concrete_dtype("cpu") == str(expected).removeprefix("torch.")
    # An explicit dtype is never changed.
    assert resolve_dtype("float32", cpu) == torch.float32
    assert EngineConfig("any", dtype="float32").concrete_dtype("cpu") == "float32"
