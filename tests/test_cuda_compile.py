"""CI check without a GPU: every kernel source compiles with nvcc for sm_80 and sm_90, with every template
instantiation the loader can ask for (the same source string NVRTC gets at run time, headers inlined).

Every instantiation goes through the front end and code generation (-ptx); ptxas, which is what takes the
time with ~200 kernels, assembles one representative shape per dtype (it is where inline PTX such as the
bf16 conversions and the quantized linear's mma, lop3 and cp.async are checked), so the test stays around
a minute and a half of CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.kernels import cuda_ops

NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_90")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


MODES = ("ptx", "cubin")


def _representative(entry: cuda_ops.Entry) -> bool:
    """Shape-free kernels, head size 128 / block size 16 / 4 heads per CTA of the attention templates, and
    of the quantized linear's every inline-PTX path (both activation types and code widths, both scale
    types, with and without offsets) at the fewest and the most rows."""
    if entry.name.startswith("quant_gemm_"):
        return entry.name.endswith(("_s32_o1_m4", "_s16_o0_m1"))
    if entry.name.startswith("quant_dequant_"):
        return entry.name.endswith("_s32_o1") or entry.name.endswith("_s16_o0")
    if not re.search(r"_d\d+_b\d+", entry.name):
        return True
    return "_d128_b16" in entry.name and entry.name.endswith(("_b16", "_g4"))


def _translation_unit(file: str, mode: str) -> str:
    # The loader compiles the source plus one entry-point line per kernel; here many of them at once.
    entries = cuda_ops.entries(file)
    if mode == "cubin":
        entries = [e for e in entries if _representative(e)]
    lines = "\n".join(entry.line for entry in entries)
    return f"{cuda_ops.kernel_source(file)}\n{lines}\n"


def _compile(source: Path, arch: str, mode: str, out_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        NVCC,
        "-std=c++17",
        f"-arch={arch}",
        f"--{mode}",
        "-Werror=all-warnings",
        "-o",
        str(out_dir / f"{source.stem}.{arch}.{mode}"),
        str(source),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, subprocess.CompletedProcess[str]]:
    # One nvcc per (file, arch, mode), run in parallel.
    out_dir = tmp_path_factory.mktemp("nvcc")
    jobs = {}
    for file in cuda_ops.CU_FILES:
        for mode in MODES:
            source = out_dir / f"{mode}_{file}"
            source.write_text(_translation_unit(file, mode))
            for arch in ARCHS:
                jobs[(file, arch, mode)] = source
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {key: pool.submit(_compile, src, key[1], key[2], out_dir) for key, src in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def test_every_kernel_file_is_listed() -> None:
    assert sorted(p.name for p in cuda_ops.KERNEL_DIR.glob("*.cu")) == sorted(cuda_ops.CU_FILES)


def test_entry_points_have_unique_names() -> None:
    names = [e.name for file in cuda_ops.CU_FILES for e in cuda_ops.entries(file)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", cuda_ops.CU_FILES)
def test_kernel_source_compiles_for_arch(compiled, file: str, arch: str, mode: str) -> None:
    result = compiled[(file, arch, mode)]
    assert result.returncode == 0, result.stderr[-4000:]
