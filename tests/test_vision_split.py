"""Images split into tiles (issue 39, DESIGN §13): tiny Idefics3 and SmolVLM (SigLIP on each
tile and on the whole image, pixel shuffle, one linear projection, a Llama decoder) against
transformers, on the ids and pixel values transformers' processor makes (tests/vision_fixtures.py
wrote the references; float32, 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

import candlewick as cw
import vision_fixtures as vf

TOL = 1e-4
CASES = list(vf.SPLIT_CASES)
IMAGE = vf.LLAVA_IMAGE  # `<image>`
TILE = vf.SPLIT_TOKENS_PER_TILE


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    name = request.param
    path = vf.materialise(name, tmp_path_factory.mktemp(name))
    rt = cw.ModelRuntime.load(str(path), dtype="f32")
    yield name, rt, vf.reference(name), path
    rt.close()


def close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.max(np.abs(a - b) / (1.0 + np.abs(b))))
    assert err <= tol, err
    return err


def chat_messages():
    return [{"role": "user", "content": [{"type": "image", "image": vf.draw_images()[1]},
                                         {"type": "text", "text": "What is this ?"}]}]


def test_both_model_types_take_images():
    assert {"idefics3", "smolvlm"} <= set(cw.supported_architectures(images=True))
    assert {"idefics3", "smolvlm"} <= set(cw.supported_architectures("gguf", images=True))


def test_every_point_matches_transformers(case):
    _, rt, ref, _ = case
    r = rt.trace(ref["one_ids"].tolist(), pixel_values=ref["one_pixel_values"])
    close(r.output.logits, ref["one_logits"])
    obs = r.observations
    checked = 0
    for key in ref:
        if key.startswith("one."):
            close(obs[key[4:]], ref[key])
            checked += 1
    # Two encoder layers, vision.output, the projector, the embeddings and four decoder layers.
    assert checked == 9
    # Five tiles (2 x 2 and the whole image), 64 patches and 16 tokens each.
    assert obs["vision.output"].shape == (5 * 64, 32)
    assert obs["vision.projector.output"].shape == (5 * TILE, 64)


def test_tiles_as_a_flat_batch_read_the_same(case):
    # The processor nests one prompt's tiles as [1, tiles, 3, S, S]; [tiles, 3, S, S] is the same.
    _, rt, ref, _ = case
    flat = ref["one_pixel_values"][0]
    close(rt.trace(ref["one_ids"].tolist(), pixel_values=flat).output.logits, ref["one_logits"])


def test_two_images_each_split(case):
    _, rt, ref, _ = case
    r = rt.trace(ref["two_ids"].tolist(), pixel_values=ref["two_pixel_values"])
    close(r.output.logits, ref["two_logits"])


def test_prefill_in_chunks_never_splits_a_tile(case):
    _, _, ref, path = case
    rt = cw.ModelRuntime.load(str(path), dtype="f32", prefill_chunk=5)
    try:
        out = rt.prefill(ref["one_ids"].tolist(), all_logits=True, pixel_values=ref["one_pixel_values"]).wait()
        close(out.logits, ref["one_logits"])
    finally:
        rt.close()


def test_generate_greedy_tokens(case):
    _, rt, ref, _ = case
    kw = dict(pixel_values=ref["one_pixel_values"], max_tokens=6, temperature=0.0, ignore_eos=True)
    g = rt.generate(ref["one_ids"].tolist(), **kw)
    assert g.token_ids == ref["one_greedy"].tolist()
    # A second question about the same image: the tiles come from the encoder cache.
    assert rt.generate(ref["one_ids"].tolist(), **kw).token_ids == g.token_ids


def test_process_makes_the_processors_ids_and_pixels(case):
    _, rt, ref, _ = case
    ids, pixels = rt.process(chat_messages())
    assert ids == ref["chat_ids"].tolist()
    close(pixels, ref["chat_pixel_values"], 1e-5)
    assert np.asarray(pixels).shape == (1, 5, 3, 32, 32)


def test_chat_with_an_image_through_the_processor(case):
    _, rt, ref, _ = case
    full = rt.trace(ref["chat_ids"].tolist(), pixel_values=ref["chat_pixel_values"])
    close(full.output.logits, ref["chat_logits"])
    r = rt.chat(chat_messages(), max_tokens=2, temperature=0.0, ignore_eos=True)
    assert r.token_ids[0] == int(np.argmax(ref["chat_logits"][-1]))
    assert r.usage["prompt_tokens"] == len(ref["chat_ids"])


def test_raw_images_expand_the_placeholder_as_the_processor_does(case):
    _, rt, ref, _ = case
    short = [1] + vf.word_ids("Describe the picture") + [IMAGE] + vf.word_ids("What is this ?")
    a = rt.trace(ref["one_ids"].tolist(), pixel_values=ref["one_pixel_values"]).output.logits
    b = rt.trace(short, images=[vf.draw_images()[0]]).output.logits
    close(b, a, 1e-5)
    ids, _ = rt.process("Describe the picture<image>What is this ?", [vf.draw_images()[0]])
    assert ids == ref["one_ids"].tolist()  # the tokenizer adds <bos> as the processor's does


def test_vision_edits_ablate_and_patch_tiles(case):
    _, rt, ref, _ = case
    ids, pv = ref["one_ids"].tolist(), ref["one_pixel_values"]
    tokens = 5 * TILE
    zero = cw.Intervention.set("vision.projector.output", [0.0] * (tokens * 64), positions=list(range(tokens)))
    r = rt.trace(ids, pixel_values=pv, interventions=[zero],
                 request=cw.ObservationRequest.select(["vision.projector.output", "model.embed_tokens"]))
    at = [i for i, t in enumerate(ids) if t == IMAGE]
    assert len(at) == tokens
    assert np.abs(r.observations["model.embed_tokens"][at]).max() == 0.0
    # Patching the image's embeddings from another run (the other image's tiles): its logits.
    other = rt.trace(ids, pixel_values=ref["chat_pixel_values"])
    values = np.asarray(other.observations["vision.projector.output"], np.float32).ravel().tolist()
    patch = cw.Intervention.set("vision.projector.output", values, positions=list(range(tokens)))
    close(rt.trace(ids, pixel_values=pv, interventions=[patch]).output.logits, other.output.logits, 1e-5)
    # Ablating the global image's patches in the first encoder layer (tile 4, rows 256..319).
    ablate = cw.Intervention.set("vision.layers.0.output", [0.0] * (64 * 32), positions=list(range(256, 320)))
    got = rt.trace(ids, pixel_values=pv, interventions=[ablate],
                   request=cw.ObservationRequest.select(["vision.projector.output"]))
    proj = got.observations["vision.projector.output"]
    close(proj[:4 * TILE], ref["one.vision.projector.output"][:4 * TILE])  # the tiles before it: untouched
    assert not np.allclose(proj[4 * TILE:], ref["one.vision.projector.output"][4 * TILE:], atol=1e-3)


def test_a_missing_tile_is_refused_before_any_step(case):
    _, rt, ref, _ = case
    rt.prefill([1, 5]).wait()
    before = rt.cached_tokens()
    ids = ref["one_ids"].tolist()
    with pytest.raises(cw.CandlewickError, match="image tokens"):
        rt.prefill(ids, pixel_values=ref["one_pixel_values"][:, :4])
    assert rt.cached_tokens() == before


def test_engine_runs_a_split_image_request_beside_a_text_one(case):
    _, rt, ref, _ = case
    ids, pv = ref["one_ids"].tolist(), ref["one_pixel_values"]
    with cw.Engine(rt, max_batch_size=4, prefill_chunk=8) as engine:
        text = engine.submit([1, 5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
        image = engine.submit(ids, pixel_values=pv, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert image.wait().token_ids == ref["one_greedy"].tolist()
        assert text.wait().token_ids == rt.generate([1, 5, 6, 7], max_tokens=6, temperature=0.0,
                                                    ignore_eos=True).token_ids


def test_server_answers_a_split_image_question_through_the_openai_client(case):
    import base64
    import socket
    import threading
    import time

    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from candlewick.serve import Server, build_app

    _, rt, ref, _ = case
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(build_app(Server(rt, "tiny-split")), host="127.0.0.1", port=port,
                                         log_level="error"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not http.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        url = "data:image/png;base64," + base64.b64encode(vf.draw_images()[1]).decode()
        r = client.chat.completions.create(model="tiny-split", max_tokens=1, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this ?"}]}])
        assert r.usage.prompt_tokens == len(ref["chat_ids"])
        assert r.choices[0].message.content == rt.tokenizer.decode([int(np.argmax(ref["chat_logits"][-1]))])
    finally:
        http.should_exit = True
        thread.join(10)


# -- GGUF language model + llama.cpp's mmproj (projector type idefics3) ---------------------------

@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """`{case: {outtype: (language model, mmproj)}}`, written on first use; the mmproj files are
    key for key and tensor for tensor what `convert_hf_to_gguf.py --mmproj` writes
    (`vf._check_mmproj` compared them when the references were made)."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("split-gguf")
    made: dict = {}

    def files(case):
        if case not in made:
            src = vf.materialise(case, root / case / "hf")
            made[case] = {t: vf.write_gguf(case, src, root / case / t, t) for t in ("f32", "q8_0")}
        return made[case]
    return files


@pytest.mark.parametrize("name", CASES)
def test_gguf_with_mmproj_f32_matches_transformers(gguf_files, name):
    """The F32 files hold the drawn weights exactly (the converter stores the projection in F32
    too): every point within DESIGN §7's float32 bound of the checkpoint's own reference."""
    lm, mmproj = gguf_files(name)["f32"]
    ref = vf.gguf_reference(name, "f32")
    with cw.ModelRuntime.load(str(lm), mmproj=str(mmproj), dtype="f32") as rt:
        r = rt.trace(ref["one_ids"].tolist(), pixel_values=ref["one_pixel_values"])
        close(r.output.logits, ref["one_logits"])
        points = [k[4:] for k in ref if k.startswith("one.")]
        for point in points:
            close(r.observations[point], ref["one." + point])
        assert len(points) == 9
        close(rt.trace(ref["two_ids"].tolist(), pixel_values=ref["two_pixel_values"]).output.logits,
              ref["two_logits"])
        g = rt.generate(ref["one_ids"].tolist(), pixel_values=ref["one_pixel_values"], max_tokens=6,
                        temperature=0.0, ignore_eos=True)
        assert g.token_ids == ref["one_greedy"].tolist()
        # `<image>` is found by name in the GGUF's tokenizer; raw images go through the processor
        # the mmproj describes (its preproc_image_size, its tile size): transformers' pixels.
        ids, pixels = rt.process(chat_messages(), chat_template=vf.tokenizer_config(name)["chat_template"])
        close(pixels, ref["chat_pixel_values"], 1e-5)
        # (The file's vocabulary names the words `<w{i}>`: the text's ids differ, the image's do not.)
        layout = set(vf.SPLIT_SPECIAL) | {IMAGE}
        assert [t for t in ids if t in layout] == [t for t in ref["chat_ids"].tolist() if t in layout]
        assert ids.count(IMAGE) == 5 * TILE


@pytest.mark.parametrize("name", CASES)
def test_gguf_with_mmproj_q8_0_within_design_bounds(gguf_files, name):
    """DESIGN §7's quantized bounds, against transformers on the files' de-quantized weights: the
    decoder runs quantized, the encoder (Q8_0 in the mmproj too) de-quantized."""
    from conftest import rel_l2

    lm, mmproj = gguf_files(name)["q8_0"]
    ref, held = vf.reference(name), vf.gguf_reference(name, "q8_0")
    with cw.ModelRuntime.load(str(lm), mmproj=str(mmproj)) as rt:
        assert "q8_0" in rt.model_info["weight_types"]
        for key in ("one", "two"):
            got = np.asarray(rt.trace(ref[f"{key}_ids"].tolist(), pixel_values=ref[f"{key}_pixel_values"]).output.logits)
            want = held[f"{key}_logits"]
            top = np.argsort(-want, axis=1)[:, :20]
            errs = np.array([rel_l2(np.take(g, t), np.take(w, t)) for g, w, t in zip(got, want, top)])
            overlap = np.array([len(set(np.argsort(-g)[:5].tolist()) & set(t[:5].tolist())) for g, t in zip(got, top)])
            ranked = np.sort(want, axis=1)
            decided = ranked[:, -1] - ranked[:, -2] > 1.0
            misses = np.flatnonzero(decided & (got.argmax(1) != want.argmax(1)))
            print(f"\n[gguf+mmproj q8_0] {name} {key}: top-20 rel L2 median {np.median(errs):.4f} (max {errs.max():.4f}); "
                  f"top-5 overlap >= 3 on {100 * np.mean(overlap >= 3):.0f}% of rows; argmax misses {len(misses)} of "
                  f"{decided.sum()} rows with margin > 1.0")
            assert np.median(errs) <= 0.05
            assert np.mean(overlap >= 3) >= 0.95
            assert len(misses) == 0, misses


def test_cli_generate_takes_an_image_with_an_idefics3_mmproj(gguf_files, tmp_path, capsys):
    """`candlewick generate --mmproj PATH --image PATH`: what the Python API answers."""
    from candlewick import cli

    lm, mmproj = gguf_files("idefics3")["f32"]
    png = tmp_path / "p.png"
    png.write_bytes(vf.draw_images()[0])
    prompt = "<image>What is this ?"
    assert cli.main(["generate", "--mmproj", str(mmproj), "--model", str(lm), "--dtype", "f32", "--device", "cpu",
                     "--image", str(png), "--temp", "0", "-n", "4", "--quiet", prompt]) == 0
    out = capsys.readouterr().out
    with cw.ModelRuntime.load(str(lm), mmproj=str(mmproj), dtype="f32") as rt:
        ids, pixels = rt.process(prompt, [str(png)])
        want = rt.generate(ids, pixel_values=pixels, max_tokens=4, temperature=0.0)
    assert ids.count(IMAGE) == 5 * TILE and np.asarray(pixels).shape == (1, 5, 3, 32, 32)
    assert out.rstrip("\n") == want.text
