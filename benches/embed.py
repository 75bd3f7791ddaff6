"""Documents per second embedding passages, candlewick beside sentence-transformers (torch) on the
same CPU threads (issue 42), on an EmbeddingGemma-shaped model.

No embedding checkpoint can be fetched here, so the model is built from Gemma 3 270M (the GGUF the
test suite uses, de-quantized by transformers): its weights saved bare as a `Gemma3TextModel` with
`use_bidirectional_attention`, then sentence-transformers' own `save` adds EmbeddingGemma-300M's
modules (mean pooling, Dense 640→2560 and 2560→640 without bias or activation, seeded, and
Normalize). The computation per token is EmbeddingGemma's, at Gemma 3 270M's width.

    # 1. build the model (torch, transformers, gguf, sentence-transformers):
    /work/bench/venv-ref/bin/python benches/embed.py build --gguf GGUF --out /tmp/embgemma
    #    or a MiniLM-L6-shaped BERT (the encoder stack; then `cw --label "MiniLM-L6-shaped BERT"`):
    /work/bench/venv-ref/bin/python benches/embed.py build-bert --out /tmp/minilm
    # 2. sentence-transformers' figure:
    /work/bench/venv-ref/bin/python benches/embed.py st --model /tmp/embgemma --json st.json
    # 3. candlewick's (float32 and q8_0) and the merged result:
    python benches/embed.py cw --model /tmp/embgemma --st st.json --json benches/results/embed.json

Each side embeds the same passages (`--docs` of about `--tokens` tokens) in batches of
`--batch`, after one warm-up batch; the best of `--repeat` runs counts, with its wall time and its
process CPU time (every thread; the steadier figure where the cores are shared). Candlewick's vectors are
compared with sentence-transformers' (cosine) so that the speed is of the same computation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

WORDS = ("the river city market winter light garden paper music station engine cloud forest road "
         "history science window letter family morning street country summer animal language").split()


def passages(n: int, tokens: int) -> list[str]:
    """`n` deterministic passages of about `tokens` words each (one token per word here)."""
    import random

    rng = random.Random(42)
    return [" ".join(rng.choice(WORDS) for _ in range(tokens - 2)) for _ in range(n)]


def build(gguf: Path, out: Path) -> None:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = out / "_base"
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    lm.hf_quantizer = None
    cfg = lm.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = lm.model
    model.config.use_bidirectional_attention = True
    model.config.architectures = ["Gemma3TextModel"]
    model.save_pretrained(base, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(base)
    word = models.Transformer(str(base), max_seq_length=512)
    h = word.get_word_embedding_dimension()
    rng = np.random.default_rng(7)
    dense = []
    for i, o in ((h, 4 * h), (4 * h, h)):
        d = models.Dense(i, o, bias=False, activation_function=torch.nn.Identity())
        d.linear.weight.data = torch.tensor(rng.standard_normal((o, i)) / np.sqrt(i), dtype=torch.float32)
        dense.append(d)
    st = SentenceTransformer(modules=[word, models.Pooling(h, pooling_mode="mean"), *dense, models.Normalize()])
    st.prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    st.save(str(out))
    print("wrote", out)


def build_bert(out: Path) -> None:
    """A MiniLM-L6-shaped BERT (all-MiniLM-L6-v2's sizes: 6 layers, width 384, 12 heads, MLP 1536),
    randomly initialised by transformers (seeded), with a WordPiece vocabulary over `WORDS` padded to
    30,522 tokens, mean pooling and Normalize, as all-MiniLM-L6-v2 ships."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    base = out / "_base"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(WORDS)))}
    for i in range(30522 - len(vocab)):
        vocab[f"[unused{i}]"] = len(vocab)
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(specials)
    cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512)
    BertModel(cfg).save_pretrained(base, safe_serialization=True)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}))
    word = models.Transformer(str(base), max_seq_length=256)
    SentenceTransformer(modules=[word, models.Pooling(384, pooling_mode="mean"), models.Normalize()]).save(str(out))
    print("wrote", out)


def timed(fn, texts, batch, repeat):
    """The best wall time of `repeat` runs, and the process CPU time (all threads) of that run:
    on cores shared with other jobs the CPU time is the steadier figure."""
    fn(texts[:batch])  # warm-up
    best, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = [fn(texts[i:i + batch]) for i in range(0, len(texts), batch)]
        if time.perf_counter() - t0 < best:
            best, cpu = time.perf_counter() - t0, time.process_time() - c0
    timed.cpu = cpu
    return best, out


def host() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_average": os.getloadavg()}


def run_st(a) -> None:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(a.threads)
    m = SentenceTransformer(str(a.model), device="cpu")
    texts = passages(a.docs, a.tokens)
    secs, out = timed(lambda b: m.encode(b, batch_size=len(b), convert_to_numpy=True), texts, a.batch, a.repeat)
    vectors = np.concatenate(out)
    np.save(str(a.json) + ".npy", vectors)
    tokens = sum(len(m.tokenizer(t)["input_ids"]) for t in texts)
    result = {"engine": f"sentence-transformers {__import__('sentence_transformers').__version__} "
                        f"(torch {torch.__version__}, {a.threads} threads)",
              "seconds": secs, "cpu_seconds": timed.cpu, "docs_per_s": a.docs / secs,
              "docs_per_cpu_s": a.docs / timed.cpu, "tokens": tokens, "host": host()}
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def run_cw(a) -> None:
    import numpy as np

    import candlewick as cw

    texts = passages(a.docs, a.tokens)
    st = json.loads(Path(a.st).read_text())
    ref = np.load(a.st + ".npy")
    rows = [dict(st, config="sentence-transformers float32")]
    for quantize in (None, "q8_0"):
        rt = cw.ModelRuntime.load(a.model, device="cpu", threads=a.threads, quantize=quantize)
        secs, out = timed(rt.embed, texts, a.batch, a.repeat)
        vectors = np.concatenate(out)
        cos = (vectors * ref).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(ref, axis=1)
        rows.append({"engine": f"candlewick {cw.__version__} ({a.threads} threads)",
                     "config": "float32" if quantize is None else f"quantize={quantize}",
                     "seconds": secs, "cpu_seconds": timed.cpu, "docs_per_s": a.docs / secs,
                     "docs_per_cpu_s": a.docs / timed.cpu, "min_cosine_vs_st": float(cos.min()),
                     "speedup_vs_st": st["seconds"] / secs, "cpu_speedup_vs_st": st["cpu_seconds"] / timed.cpu,
                     "host": host()})
        print(json.dumps(rows[-1]))
        rt.close()
    result = {"model": a.label,
              "docs": a.docs, "tokens_per_doc": st["tokens"] / a.docs, "batch": a.batch, "repeat": a.repeat,
              "rows": rows}
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["build", "build-bert", "st", "cw"])
    p.add_argument("--gguf", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--model", type=Path)
    p.add_argument("--st", help="sentence-transformers' result JSON (cw)")
    p.add_argument("--json", default="embed.json")
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--label", default="EmbeddingGemma-shaped (Gemma 3 270M weights, bidirectional, mean pooling, Dense x2)",
                   help="what the model is, for the result (cw)")
    a = p.parse_args()
    {"build": lambda: build(a.gguf, a.out), "build-bert": lambda: build_bert(a.out), "st": lambda: run_st(a),
     "cw": lambda: run_cw(a)}[a.what]()


if __name__ == "__main__":
    main()
