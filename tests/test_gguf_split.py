"""Split GGUF files, as llama.cpp's gguf-split writes them (`name-00001-of-00003.gguf`, …: the
first part holds the metadata and `split.count`, every part is a GGUF file of its own holding
some of the tensors).

The parts are written from the tiny llama with the `gguf` package's split writer (what the
converter's `--split-max-tensors` runs; `gguf_convert.convert`), and the split model must give the
same logits as the whole file, bit for bit: every tensor is the same bytes, read from another
file. Then each way a split file can be broken must raise a typed error naming the file at fault.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest

import candlewick as cw
import gguf_convert
from conftest import TINY

gguf = pytest.importorskip("gguf")

IDS = [1, 2, 3, 4, 5, 6, 7]
PROMPT = "<t1><t2><t3>"  # the converted GGUF's vocabulary is `<t0>` … (gguf_convert._minimal_vocab)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-split")


@pytest.fixture(scope="module")
def whole(root):
    """The tiny llama as one file, float32 and Q8_0."""
    return {q: gguf_convert.convert(TINY / "llama", root / f"whole-{q}.gguf", q) for q in (gguf_convert.F32,
                                                                                             gguf_convert.Q8_0)}


def write_split(root: Path, whole: dict, outtype: str, parts: int, small_first: bool = False) -> list:
    """The tiny llama in `parts` parts (`small_first`: the first holding only the metadata, as
    gguf-split's `--no-tensor-first-split`); returns the parts, in order."""
    dest = root / f"{outtype}-{parts}{'-small' if small_first else ''}"
    if not dest.exists():
        dest.mkdir()
        n = len(gguf.GGUFReader(str(whole[outtype])).tensors)
        per = -(-n // (parts - 1 if small_first else parts))
        gguf_convert.convert(TINY / "llama", dest / "tiny.gguf", outtype, split_max_tensors=per,
                             small_first_shard=small_first)
    files = sorted(dest.glob("tiny-*-of-*.gguf"))
    assert [f.name for f in files] == [f"tiny-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
    return files


def logits(path, **options):
    return np.asarray(cw.ModelRuntime.load(path, device="cpu", **options).prefill(IDS).wait().logits)


@pytest.mark.parametrize("outtype", [gguf_convert.F32, gguf_convert.Q8_0])
@pytest.mark.parametrize("parts,small_first", [(2, False), (3, False), (3, True)])
def test_a_split_file_gives_the_whole_files_logits(root, whole, outtype, parts, small_first):
    files = write_split(root, whole, outtype, parts, small_first)
    fields = gguf.GGUFReader(str(files[0])).fields
    assert int(fields["split.count"].parts[-1][0]) == parts
    if small_first:
        assert len(gguf.GGUFReader(str(files[0])).tensors) == 0
    assert all(len(gguf.GGUFReader(str(f)).tensors) > 0 for f in files[1 if small_first else 0:])
    # The same bytes, read from other files: the same logits exactly, kept quantized (Q8_0's
    # blocks straight into the int8 kernels) and de-quantized at load.
    np.testing.assert_array_equal(logits(files[0]), logits(whole[outtype]))
    if outtype == gguf_convert.Q8_0:
        np.testing.assert_array_equal(logits(files[0], dtype="f32"), logits(whole[outtype], dtype="f32"))
    # The tokenizer comes from the first part's metadata.
    split_text = cw.ModelRuntime.load(files[0], device="cpu").generate(PROMPT, max_tokens=4, temperature=0.0).text
    whole_text = cw.ModelRuntime.load(whole[outtype], device="cpu").generate(PROMPT, max_tokens=4,
                                                                            temperature=0.0).text
    assert split_text == whole_text


@pytest.mark.parametrize("case,outtype,experts", [("qwen3_moe", gguf_convert.Q8_0, None),
                                                   ("gpt_oss", gguf_convert.Q8_0, "mxfp4")])
def test_split_mixtures_give_the_whole_files_logits(tmp_path, case, outtype, experts):
    """Experts read one at a time from their part (`expert_matmul`), Q8_0's and MXFP4's (a type
    candle lacks, read into its own tiles or re-encoded as Q8_0)."""
    src = TINY / case
    one = gguf_convert.convert(src, tmp_path / "whole.gguf", outtype, experts=experts)
    n = len(gguf.GGUFReader(str(one)).tensors)
    parts = gguf_convert.convert(src, tmp_path / "split.gguf", outtype, experts=experts, split_max_tensors=-(-n // 3))
    assert len(parts) == 3
    exps = [t.tensor_type.name for f in parts[1:] for t in gguf.GGUFReader(str(f)).tensors if "_exps" in t.name]
    assert exps and (experts is None or "MXFP4" in exps), exps
    np.testing.assert_array_equal(logits(parts[0]), logits(one))
    np.testing.assert_array_equal(logits(parts[0], dtype="f32"), logits(one, dtype="f32"))


@pytest.fixture
def broken(root, whole, tmp_path):
    """A fresh copy of the three-part float32 split, to break."""
    files = write_split(root, whole, gguf_convert.F32, 3)
    return [Path(shutil.copy(f, tmp_path / f.name)) for f in files]


def test_a_later_part_names_the_first(broken):
    for i in (1, 2):
        with pytest.raises(cw.ArtifactError) as e:
            cw.ModelRuntime.load(broken[i], device="cpu")
        msg = str(e.value)
        assert f"part {i + 1} of 3" in msg and str(broken[0]) in msg, msg


def test_a_missing_part_is_named(broken):
    broken[2].unlink()
    with pytest.raises(cw.ArtifactError, match="part 3 of 3") as e:
        cw.ModelRuntime.load(broken[0], device="cpu")
    assert str(broken[2]) in str(e.value)


def test_a_part_of_another_split_is_refused(root, whole, broken):
    # The second part of the two-part split, where the three-part split's second should be.
    other = write_split(root, whole, gguf_convert.F32, 2)
    shutil.copy(other[1], broken[1])
    with pytest.raises(cw.ArtifactError, match="another split") as e:
        cw.ModelRuntime.load(broken[0], device="cpu")
    assert str(broken[1]) in str(e.value) and "`split.count` = 2" in str(e.value)


def test_a_part_out_of_place_is_refused(broken):
    # Parts 2 and 3 swapped by name.
    tmp = broken[1].with_suffix(".tmp")
    broken[1].rename(tmp)
    broken[2].rename(broken[1])
    tmp.rename(broken[2])
    with pytest.raises(cw.ArtifactError, match=r"`split\.no` = 2 \(part 3 of 3\) where part 2 was expected"):
        cw.ModelRuntime.load(broken[0], device="cpu")


def test_a_tensor_in_two_parts_is_refused(broken):
    # The last part rewritten with a tensor of the first beside its own, split keys and all.
    first = gguf.GGUFReader(str(broken[0]))
    last = gguf.GGUFReader(str(broken[2]))
    taken = first.tensors[0]
    # Written beside it and moved over it: the readers map the files they read.
    new = broken[2].with_suffix(".new")
    w = gguf.GGUFWriter(str(new), "llama")
    w.add_uint16("split.no", 2)
    w.add_uint16("split.count", 3)
    w.add_int32("split.tensors.count", int(first.fields["split.tensors.count"].parts[-1][0]))
    for t in [*last.tensors, taken]:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    new.replace(broken[2])
    with pytest.raises(cw.ArtifactError, match=f"holds tensor `{taken.name}`") as e:
        cw.ModelRuntime.load(broken[0], device="cpu")
    assert str(broken[2]) in str(e.value) and str(broken[0]) in str(e.value)


def test_a_truncated_part_is_refused(broken):
    data = broken[1].read_bytes()
    broken[1].write_bytes(data[:-100])
    with pytest.raises(cw.ArtifactError, match="needs bytes up to") as e:
        cw.ModelRuntime.load(broken[0], device="cpu")
    assert f"malformed GGUF file {broken[1]}" in str(e.value)


def test_a_renamed_first_part_cannot_find_the_others(broken, tmp_path):
    renamed = broken[0].rename(tmp_path / "tiny.gguf")
    with pytest.raises(cw.ArtifactError, match=r"does not end in `-00001-of-00003\.gguf`"):
        cw.ModelRuntime.load(renamed, device="cpu")


def test_a_non_finite_weight_names_its_part(broken):
    # A NaN in the last part's first tensor: the check that runs as tensors are read names the
    # file it came from.
    t = gguf.GGUFReader(str(broken[2])).tensors[0]
    data = bytearray(broken[2].read_bytes())
    data[t.data_offset:t.data_offset + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    broken[2].write_bytes(bytes(data))
    with pytest.raises(cw.ArtifactError, match="check_tensors=False") as e:
        cw.ModelRuntime.load(broken[0], device="cpu")
    assert f"malformed GGUF file {broken[2]}" in str(e.value) and t.name in str(e.value)
    cw.ModelRuntime.load(broken[0], device="cpu", check_tensors=False)
