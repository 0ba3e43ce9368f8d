"""The CPU's features come from /proc/cpuinfo, never assumed: two real boxes' flags, and this one."""

from __future__ import annotations

from ops.platforms.cpu_features import cpu_features, parse_cpuinfo

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni
"""


def test_an_epyc_with_bf16_and_a_xeon_without() -> None:
    epyc, xeon = cpu_features(EPYC), cpu_features(XEON)
    assert epyc.model_name == "AMD EPYC 9R14 96-Core Processor"
    assert (epyc.avx512f, epyc.avx512_bf16, epyc.avx512_vnni, epyc.amx_bf16) == (True, True, True, False)
    assert xeon.model_name.startswith("Intel(R) Xeon(R) Platinum 8375C")
    assert (xeon.avx512f, xeon.avx512_bf16, xeon.avx512_vnni) == (True, False, True)


def test_no_cpuinfo_says_unknown_and_claims_nothing() -> None:
    assert parse_cpuinfo("") == ("unknown", set())
    features = cpu_features("")
    assert not (features.avx512f or features.avx512_bf16 or features.avx512_vnni or features.amx_int8)


def test_this_machine_agrees_with_its_own_cpuinfo() -> None:
    text = open("/proc/cpuinfo").read()
    name, flags = parse_cpuinfo(text)
    features = cpu_features()
    assert features.model_name == name != "unknown"
    assert features.avx512_bf16 == ("avx512_bf16" in flags)
    assert features.avx512f == ("avx512f" in flags)
