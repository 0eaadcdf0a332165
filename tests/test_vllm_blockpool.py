"""vLLM's files for the comparisons: extracted from a wheel unmodified, loaded beside stand-ins,
and driven (``bench blockpool``) the way vLLM's scheduler drives its BlockPool; the bench skips
cleanly without them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpubd.tools import vllm_blockpool, vllm_source
from kvpubd.tools.bench_prompts import make_prompts

# Looked up where a bench run looks (the environment of the test run, before any monkeypatch).
VLLM_FILES_MISSING = vllm_blockpool.missing_files()
needs_vllm_files = pytest.mark.skipif(
    bool(VLLM_FILES_MISSING), reason="vLLM's files not extracted (kvpubd bench vllm-extract)"
)


@pytest.fixture
def vllm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "vllm-files"
    monkeypatch.setenv(vllm_source.DIR_ENV_VAR, str(directory))
    monkeypatch.delenv(vllm_source.ENV_VAR, raising=False)
    return directory


def synthetic_wheel(path: Path, members: tuple[str, ...], version: str = "9.9.9") -> Path:
    """A zip laid out as vLLM's wheel: each member holds its own name, plus the metadata."""
    with zipfile.ZipFile(path, "w") as archive:
        for member in members:
            archive.writestr(member, f"# {member}\n")
        archive.writestr("vllm/other.py", "# not needed\n")
        archive.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
    return path


def test_extract_copies_every_file_the_comparisons_load(tmp_path: Path, vllm_dir: Path) -> None:
    wheel = synthetic_wheel(tmp_path / "vllm.whl", vllm_source.WHEEL_MEMBERS)
    written = vllm_source.extract_from_wheel(wheel)
    assert written == [vllm_source.member_path(m) for m in vllm_source.WHEEL_MEMBERS]
    for member in vllm_source.WHEEL_MEMBERS:
        # By file name, kv_events.py where publisher --against-vllm has always looked.
        path = vllm_dir / Path(member).name
        assert path.read_text() == f"# {member}\n"
    assert vllm_source.kv_events_path() == vllm_dir / "kv_events.py"
    assert vllm_blockpool.missing_files() == []
    assert vllm_source.extracted_version() == "9.9.9"
    assert not (vllm_dir / "other.py").exists()


def test_kv_events_env_var_still_names_its_file(
    tmp_path: Path, vllm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere" / "events.py"
    monkeypatch.setenv(vllm_source.ENV_VAR, str(elsewhere))
    vllm_source.extract_from_wheel(
        synthetic_wheel(tmp_path / "vllm.whl", vllm_source.WHEEL_MEMBERS)
    )
    assert elsewhere.read_text() == f"# {vllm_source.WHEEL_MEMBER}\n"
    assert not (vllm_dir / "kv_events.py").exists()
    assert vllm_blockpool.source_paths()["vllm.distributed.kv_events"] == elsewhere


def test_extract_from_a_wheel_without_a_needed_file_writes_nothing(
    tmp_path: Path, vllm_dir: Path
) -> None:
    members = tuple(m for m in vllm_source.WHEEL_MEMBERS if not m.endswith("block_pool.py"))
    with pytest.raises(KeyError, match=r"block_pool\.py"):
        vllm_source.extract_from_wheel(synthetic_wheel(tmp_path / "vllm.whl", members))
    assert not vllm_dir.exists()
    assert len(vllm_blockpool.missing_files()) == len(vllm_source.WHEEL_MEMBERS)


@pytest.mark.process
def test_bench_blockpool_skips_cleanly_without_the_files(tmp_path: Path) -> None:
    empty = tmp_path / "nothing-here"
    env = {k: v for k, v in os.environ.items() if k != vllm_source.ENV_VAR}
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "bench", "blockpool", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, vllm_source.DIR_ENV_VAR: str(empty)},
    )
    assert result.returncode == 0, result.stderr
    skipped = json.loads(result.stdout)["skipped"]
    assert str(empty / "block_pool.py") in skipped and "vllm-extract" in skipped
    assert "comparison skipped" in result.stderr


def unique_full_blocks(prompts: list[bytes], block_size: int = 16) -> int:
    """What either cache must store when nothing is evicted: one block per distinct prefix of
    whole blocks, counted here without either implementation."""
    seen: set[bytes] = set()
    step = block_size * 4  # packed uint32
    for prompt in prompts:
        digest = b""
        for start in range(0, len(prompt) // step * step, step):
            digest = hashlib.sha256(digest + prompt[start : start + step]).digest()
            seen.add(digest)
    return len(seen)


@needs_vllm_files
@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
def test_vllm_and_kvpubd_store_the_same_blocks(algorithm: str) -> None:
    from kvpubd.tools.bench_blockpool import measure_kvpubd, measure_vllm

    prompts = make_prompts(24)
    expected = unique_full_blocks(prompts)
    was_loaded = "vllm" in sys.modules
    vllm = measure_vllm(prompts, algorithm, num_blocks=16_384)  # type: ignore[arg-type]
    ours = measure_kvpubd(prompts, algorithm, num_blocks=16_384)  # type: ignore[arg-type]
    assert ("vllm" in sys.modules) == was_loaded  # the stand-ins are gone again
    assert vllm["stored_blocks"] == ours["stored_blocks"] == expected
    assert vllm["removed_blocks"] == ours["removed_blocks"] == 0
    assert ours["dropped_stored_blocks"] == 0
    assert vllm["batches"] > 0 and vllm["payload_bytes"] > 0
    assert vllm["us_per_block"] > 0 and ours["us_per_block"] > 0
    assert vllm["vllm_version"] == vllm_source.extracted_version()


@needs_vllm_files
def test_a_full_vllm_pool_evicts_and_says_so() -> None:
    from kvpubd.tools.bench_blockpool import measure_kvpubd, measure_vllm

    prompts = make_prompts(24)
    expected = unique_full_blocks(prompts)
    vllm = measure_vllm(prompts, "sha256", num_blocks=2048)
    ours = measure_kvpubd(prompts, "sha256", num_blocks=2048)
    for run in (vllm, ours):
        # What is evicted may be stored again by a later prompt, never less than once.
        assert run["removed_blocks"] > 0 and run["stored_blocks"] >= expected
        assert run["stored_blocks"] - run["removed_blocks"] <= 2048
