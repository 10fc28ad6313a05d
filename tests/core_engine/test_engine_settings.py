"""Fern's settings objects: importable without torch, and FERN_* switches mapped onto the frozen configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core_engine.graphs import BucketConfig as GraphsBucketConfig
from core_engine.settings import BucketConfig, EngineConfig, KernelOptions

ROOT = Path(__file__).resolve().parents[2]


def test_settings_import_no_torch():
    code = "import sys, core_engine.settings; assert 'torch' not in sys.modules, 'settings imported torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_bucket_config_is_one_class_under_both_names():
    assert GraphsBucketConfig is BucketConfig
    assert EngineConfig().buckets == BucketConfig()


def test_kernel_options_from_env_maps_each_switch():
    assert KernelOptions.from_env({}) == KernelOptions()
    off = KernelOptions.from_env({"FERN_GELU_EPILOGUE": "0", "FERN_ADDMM_RESIDUAL": "1", "FERN_TRITON_KERNELS": "0",
                                  "FERN_FULL_LAST_LAYER": "1", "FERN_FLASHINFER_BACKEND": "fa3",
                                  "FERN_FLASHINFER_CONTIGUOUS": "0"})
    assert off == KernelOptions(gelu_epilogue=False, opaque_residual=False, triton_kernels=False, pool_early=False,
                                flashinfer_backend="fa3", flashinfer_contiguous=False)


def test_engine_config_from_env_keeps_given_options():
    config = EngineConfig.from_env({"FERN_COMPILE": "0", "FERN_COMPILE_BACKEND": "eager",
                                    "FERN_TRITON_KERNELS": "0"}, attention="cpu")
    assert config.compile is False and config.compile_backend == "eager" and config.attention == "cpu"
    assert config.kernels.triton_kernels is False
    assert EngineConfig.from_env({}).compile is None
