"""With DIFFULEX_TRITON_COMPILE_LOG set, every Triton compile of a process that asks for the log, and of the compile
helpers an engine starts, lands in the one file: the kernel, the time, whether the cache had it, the kind of process
and the test the session named. Without it nothing is logged."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.test_parallel_compile import run_case  # noqa: E402

BODY = '''
    from diffulex.kernels.compile_log import LOG_ENV, TEST_ENV, log_compiles_from_env

    os.environ.pop(LOG_ENV, None)
    unset = log_compiles_from_env("test process")
    os.environ[LOG_ENV] = os.environ["TRITON_CACHE_DIR"] + "-log.jsonl"
    os.environ[TEST_ENV] = "tests/a.py::test_one"
    x, y = torch.ones(1024), torch.zeros(1024)
    variants = pc.record_launches(lambda: scale.warmup(x, y, 1024, BLOCK=256, grid=(4,)))
    helpers = pc.CompileHelpers(1)  # started now: it inherits the variables
    try:
        helpers.compile_variants(variants, HOPPER)
    finally:
        helpers.close()
    set_here = log_compiles_from_env("test process")
    os.environ[TEST_ENV] = "tests/a.py::test_two"
    scale.warmup(x, y, 1024, BLOCK=128, grid=(4,))  # compiled here
    scale.warmup(x, y, 1024, BLOCK=256, grid=(4,))  # the helper's, from the cache
    with open(os.environ[LOG_ENV]) as log:
        lines = [json.loads(line) for line in log]
    print(json.dumps({"unset": unset, "set": set_here, "lines": lines}))
'''


def test_the_helpers_and_the_test_process_log_each_compile_with_its_test(tmp_path):
    seen = run_case(tmp_path, BODY)
    assert seen["unset"] is False and seen["set"] is True
    compiled = [(line["process"], line["test"], line["hit"]) for line in seen["lines"] if not line["hit"]]
    assert compiled == [
        ("compile helper", "tests/a.py::test_one", False), ("test process", "tests/a.py::test_two", False)
    ]
    assert all(line["kernel"] == "scale" and line["us"] > 0 for line in seen["lines"] if not line["hit"])
