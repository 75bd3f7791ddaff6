"""Time to prefill a prompt with one image (the vision encoder, the projector and the prompt's
prefill together), candlewick beside transformers (torch) on the same CPU threads (issue 39).

No vision-language checkpoint can be fetched here, so the model is drawn at random (seeded) by
transformers: a `Gemma3ForConditionalGeneration` whose vision tower has SigLIP-B/16's shape at
224 px (12 layers, width 768, 196 patches, 86M parameters), pooled to 49 image tokens, and whose
language model has Gemma 3 270M's shape (18 layers, width 640) with the tests' small vocabulary.
The work per image is a real SigLIP-B/16's; Gemma 3 4B's own encoder (SigLIP So400m at 896 px,
4,096 patches) is about 60 times more and out of reach of a 2-core machine for transformers.

    # 1. build the model (torch, transformers):
    /work/bench/venv-ref/bin/python benches/vision.py build --out /tmp/vlm
    # 2. transformers' figure:
    /work/bench/venv-ref/bin/python benches/vision.py hf --model /tmp/vlm --json hf.json
    # 3. candlewick's, and the merged result:
    python benches/vision.py cw --model /tmp/vlm --hf hf.json --json benches/results/vision.json

Each side runs the same ids and pixel values (transformers' processor's, on a seeded 640x480
image): the prompt with its image (encoder + prefill), and the same prompt without the image's
pixels (its tokens as text: prefill alone), after one warm-up; the best of `--repeat` runs counts,
with its wall time and process CPU time. Each run's pixels differ in the last bit of one value,
so that candlewick's encoder cache (which would skip the encoder for a repeated image) never
serves it. The last row's logits are compared, so that the speed is of the same computation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
TOKENS_PER_IMAGE = 49


def build(out: Path) -> None:
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    sys.path.insert(0, str(TESTS))
    import vision_fixtures as vf

    torch.manual_seed(3901)
    text = transformers.Gemma3TextConfig(
        vocab_size=vf.VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                             num_attention_heads=12, image_size=224, patch_size=16,
                                             layer_norm_eps=1e-6, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                       boi_token_index=vf.BOI, eoi_token_index=vf.EOI, image_token_index=vf.SOFT)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    transformers.Gemma3ImageProcessor(size={"height": 224, "width": 224}).save_pretrained(out)
    (out / "tokenizer.json").write_text(vf.tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps(vf.tokenizer_config("gemma3")))
    rng = np.random.default_rng(3902)
    img = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    proc = transformers.Gemma3ImageProcessor.from_pretrained(out)
    pixels = proc(images=[img], return_tensors="np")["pixel_values"].astype(np.float32)
    ids = [1] + vf.word_ids("Describe the picture" + vf.image_text("gemma3", TOKENS_PER_IMAGE)
                            + "What is this ? Here it is a red cat and a blue dog in the picture .")
    np.savez(out / "bench_inputs.npz", ids=np.array(ids, np.int64), pixel_values=pixels)
    n = sum(p.numel() for p in model.model.vision_tower.parameters())
    print(f"wrote {out}: {len(ids)} prompt tokens, vision tower {n / 1e6:.1f}M parameters")


def inputs(model: Path):
    import numpy as np

    d = np.load(model / "bench_inputs.npz")
    return d["ids"].tolist(), d["pixel_values"]


def nudged(pixels, k: int):
    """`pixels` with one value moved by about 1e-6: another image to the encoder cache, the same
    to the eye."""
    import numpy as np

    p = pixels.copy()
    p.flat[0] += np.float32(1e-6) * np.float32(k + 2)
    return p


def best(fn, repeat: int) -> dict:
    fn(-1)  # warm-up
    runs = []
    for k in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn(k)
        runs.append((time.perf_counter() - w, time.process_time() - c))
    wall, cpu = min(runs)
    return {"seconds": wall, "cpu_seconds": cpu, "runs": [r[0] for r in runs]}


def host() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


def run_hf(model: Path, threads: int, repeat: int) -> dict:
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    m = transformers.Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    ids, pixels = inputs(model)
    tids = torch.tensor(ids)[None]
    types = (tids == m.config.image_token_index).long()
    out = {}

    def image(k):
        with torch.no_grad():
            out["logits"] = m(input_ids=tids, pixel_values=torch.from_numpy(nudged(pixels, k)), token_type_ids=types,
                              use_cache=True, logits_to_keep=1).logits[0, -1].numpy()

    def text(k):
        with torch.no_grad():
            m(input_ids=tids, use_cache=True, logits_to_keep=1)

    res = {"library": f"transformers {transformers.__version__}, torch {torch.__version__}", "threads": threads,
           "image_prefill": best(image, repeat), "text_prefill": best(text, repeat)}
    res["last_logits"] = np.asarray(out["logits"], np.float64).tolist()
    return res


def run_cw(model: Path, threads: int, repeat: int) -> dict:
    import numpy as np

    import candlewick as cw

    rt = cw.ModelRuntime.load(str(model), dtype="f32", threads=threads)
    ids, pixels = inputs(model)
    out = {}

    def image(k):
        rt.session.reset()
        out["logits"] = np.asarray(rt.prefill(ids, pixel_values=nudged(pixels, k)).wait().logits)[-1]

    def text(k):
        rt.session.reset()
        rt.prefill(ids).wait()

    res = {"library": f"candlewick {cw.__version__}", "threads": threads, "image_prefill": best(image, repeat),
           "text_prefill": best(text, repeat)}
    res["last_logits"] = np.asarray(out["logits"], np.float64).tolist()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    for name in ("hf", "cw"):
        p = sub.add_parser(name)
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--threads", type=int, default=os.cpu_count())
        p.add_argument("--repeat", type=int, default=5)
        p.add_argument("--json", type=Path, required=True)
        if name == "cw":
            p.add_argument("--hf", type=Path, required=True, help="transformers' result (the hf command's --json)")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
        return
    if args.cmd == "hf":
        res = {"host": host(), "transformers": run_hf(args.model, args.threads, args.repeat)}
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps({k: v for k, v in res["transformers"].items() if k != "last_logits"}, indent=2))
        return
    import numpy as np

    hf = json.loads(args.hf.read_text())
    cwr = run_cw(args.model, args.threads, args.repeat)
    a, r = np.asarray(cwr.pop("last_logits")), np.asarray(hf["transformers"].pop("last_logits"))
    res = {
        "model": "Gemma3ForConditionalGeneration, random (seed 3901): SigLIP-B/16 at 224 px (12 layers, width 768, "
                 "196 patches) pooled to 49 tokens; language model of Gemma 3 270M's shape (18 layers, width 640), "
                 "vocabulary 512; float32",
        "prompt_tokens": len(inputs(args.model)[0]),
        "host_transformers": hf["host"], "host_candlewick": host(),
        "transformers": hf["transformers"], "candlewick": cwr,
        "last_logits_rel_l2": float(np.linalg.norm(a - r) / np.linalg.norm(r)),
    }
    for key in ("image_prefill", "text_prefill"):
        res[f"{key}_speedup"] = hf["transformers"][key]["seconds"] / cwr[key]["seconds"]
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=2))
    for side in ("transformers", "candlewick"):
        print(side, {k: round(res[side][k]["seconds"], 4) for k in ("image_prefill", "text_prefill")})


if __name__ == "__main__":
    main()
