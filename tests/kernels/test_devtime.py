"""The profiler-trace device timer: kernels on GPU stream threads only, per-call sums, spans and counts."""

import jax
import pytest

from pallas_kernels import devtime


def _trace():
    meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "python3"}}]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "name": "fusion_1", "ts": 100.0, "dur": 10.0},
               {"ph": "X", "pid": 1, "tid": 7, "name": "sort", "ts": 115.0, "dur": 30.0},
               {"ph": "X", "pid": 1, "tid": 7, "name": "fusion_1", "ts": 200.0, "dur": 12.0},
               {"ph": "X", "pid": 1, "tid": 7, "name": "sort", "ts": 214.0, "dur": 28.0}]
    host = [{"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction", "ts": 0.0, "dur": 500.0}]
    return {"traceEvents": meta + kernels + host}


def test_summary_counts_device_streams_only():
    got = devtime.summarize(devtime.stream_kernels(_trace()), calls=2)
    assert got["busy_us"] == pytest.approx((10 + 30 + 12 + 28) / 2)  # the host event is not device time
    assert got["span_us"] == pytest.approx((242 - 100) / 2)
    assert got["kernels_per_call"] == 2
    assert got["top"] == {"sort": 29.0, "fusion_1": 11.0}
    assert got["last_call"] == [["fusion_1", 12.0], ["sort", 28.0]]


def test_no_kernels_and_no_gpu():
    assert devtime.summarize([], calls=3)["busy_us"] is None
    if jax.default_backend() != "gpu":
        assert devtime.device_time(lambda x: x + 1, jax.numpy.ones(3)) is None


def test_sass_opcode_mix():
    from pallas_kernels.sass_mix import opcodes

    listing = """
        /*0050*/                   FSETP.GE.AND P0, PT, R2, R3, PT ;
        /*0060*/              @!P0 BRA 0x120 ;
        /*0070*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0080*/                   IADD3 R5, R4, 0x1, RZ ;
    """
    assert opcodes(listing) == {"FSETP.GE.AND": 1, "BRA": 1, "IADD3": 2}
