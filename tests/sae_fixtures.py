"""Seeded random sparse autoencoders for the tiny checkpoints, saved in each published format,
and transformers' outputs with their feature edits applied through torch hooks.

The SAEs are not stored (weights stay out of git): `materialise(root)` draws every tensor from
numpy's PCG64 generator with the seed in `SAES` and writes SAELens directories (cfg.json +
sae_weights.safetensors), a Gemma Scope params.npz and a sparsify directory (cfg.json +
sae.safetensors) under `root`. `np_run` is the numpy reference of DESIGN §15 the tests compare
features, reconstruction and error with, on the activations the fixtures' reference.safetensors
hold (transformers' own). What is stored, in tests/data/sae/<arch>/: `edits.safetensors` and
`edits.json`, the logits of prompt + greedy continuation (teacher-forced) with each case's edit
applied by a torch hook at the SAE's point, at every position.

    /work/bench/venv-ref/bin/python tests/sae_fixtures.py   (needs torch and transformers 5.x)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "sae"
TINY = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "tiny"
D_IN, D_SAE, K = 64, 128, 8

# name: (format, hook as the file names it (None: Gemma Scope, given as point=), architecture,
#        normalisation, apply_b_dec_to_input, seed)
SAES = {
    "standard": ("saelens", "blocks.1.hook_resid_post", "standard", "none", True, 101),
    "jumprelu": ("saelens", "blocks.0.hook_mlp_out", "jumprelu", "none", False, 102),
    "topk": ("saelens", "blocks.2.hook_resid_pre", "topk", "none", True, 103),
    "gated": ("saelens", "blocks.1.hook_attn_out", "gated", "none", True, 104),
    "layernorm": ("saelens", "blocks.2.hook_resid_post", "standard", "layer_norm", False, 105),
    "rescale": ("saelens", "blocks.0.hook_resid_post", "standard", "constant_norm_rescale", True, 106),
    "scope": ("gemma-scope", None, "jumprelu", "none", False, 107),
    "sparsify": ("sparsify", "layers.1", "topk", "none", True, 108),
    "hookz": ("saelens", "blocks.1.attn.hook_z", "standard", "none", True, 109),
}
SCOPE_POINT = "model.layers.1.output"
POINTS = {
    "blocks.1.hook_resid_post": "model.layers.1.output",
    "blocks.0.hook_mlp_out": "model.layers.0.mlp.output",
    "blocks.2.hook_resid_pre": "model.layers.2.input",
    "blocks.1.hook_attn_out": "model.layers.1.attention.output",
    "blocks.2.hook_resid_post": "model.layers.2.output",
    "blocks.0.hook_resid_post": "model.layers.0.output",
    "layers.1": "model.layers.1.output",
    "blocks.1.attn.hook_z": "model.layers.1.attention.heads",
}


def point_of(name: str) -> str:
    hook = SAES[name][1]
    return SCOPE_POINT if hook is None else POINTS[hook]


def weights(name: str) -> dict:
    """The SAE's tensors in SAELens's names and layout (W_enc [d_in, d_sae], W_dec [d_sae, d_in])."""
    _, _, arch, _, _, seed = SAES[name]
    rng = np.random.default_rng(seed)
    f32 = np.float32
    w = {
        "W_enc": f32(0.4) * rng.standard_normal((D_IN, D_SAE), dtype=f32),
        "b_enc": f32(0.1) * rng.standard_normal(D_SAE, dtype=f32) - f32(0.2),
        "W_dec": f32(0.2) * rng.standard_normal((D_SAE, D_IN), dtype=f32),
        "b_dec": f32(0.05) * rng.standard_normal(D_IN, dtype=f32),
    }
    if arch == "jumprelu":
        w["threshold"] = np.abs(f32(0.5) * rng.standard_normal(D_SAE, dtype=f32))
    if arch == "gated":
        w["b_gate"] = w.pop("b_enc")
        w["r_mag"] = f32(0.2) * rng.standard_normal(D_SAE, dtype=f32)
        w["b_mag"] = f32(0.1) * rng.standard_normal(D_SAE, dtype=f32)
    return w


def materialise(root: Path) -> dict:
    """Writes every SAE in its format under `root`; returns name -> the path to attach."""
    from safetensors.numpy import save_file

    out = {}
    for name, (fmt, hook, arch, norm, apply_b_dec, _) in SAES.items():
        w = weights(name)
        if fmt == "saelens":
            d = root / name
            d.mkdir(parents=True, exist_ok=True)
            cfg = dict(architecture=arch, d_in=D_IN, d_sae=D_SAE, hook_name=hook, hook_layer=int(hook.split(".")[1]),
                       apply_b_dec_to_input=apply_b_dec, normalize_activations=norm, dtype="float32",
                       device="cpu", model_name="tiny", context_size=128, prepend_bos=True,
                       dataset_path="", hook_head_index=None, finetuning_scaling_factor=False,
                       sae_lens_training_version=None, activation_fn_kwargs={})
            if arch == "topk":
                cfg["k"] = K
                cfg["activation_fn_kwargs"] = {"k": K}
            (d / "cfg.json").write_text(json.dumps(cfg, indent=1))
            save_file(w, str(d / "sae_weights.safetensors"))
            out[name] = d
        elif fmt == "gemma-scope":
            d = root / name
            d.mkdir(parents=True, exist_ok=True)
            np.savez(d / "params.npz", **w)
            out[name] = d / "params.npz"
        else:
            d = root / name / hook
            d.mkdir(parents=True, exist_ok=True)
            cfg = dict(activation="topk", expansion_factor=D_SAE // D_IN, normalize_decoder=True,
                       num_latents=D_SAE, k=K, multi_topk=False, skip_connection=False, transcode=False, d_in=D_IN)
            (d / "cfg.json").write_text(json.dumps(cfg, indent=1))
            save_file({"encoder.weight": np.ascontiguousarray(w["W_enc"].T), "encoder.bias": w["b_enc"],
                       "W_dec": w["W_dec"], "b_dec": w["b_dec"]}, str(d / "sae.safetensors"))
            out[name] = d
    return out


def activations(arch: str = "llama") -> dict:
    """transformers' activations of the fixture's prompt: every point of reference.safetensors, and
    `attention.heads` / `mlp.hidden` from interventions.safetensors."""
    from safetensors.numpy import load_file

    out = load_file(str(TINY / arch / "interventions.safetensors"))
    out.update(load_file(str(TINY / arch / "reference.safetensors")))
    return out


def np_features(name: str, x: np.ndarray):
    """Features of float32 rows `x` [T, d_in] (heads read flat), and how the reconstruction is scaled back."""
    _, _, arch, norm, apply_b_dec, _ = SAES[name]
    w = weights(name)
    x = x.reshape(len(x), -1).astype(np.float64)
    scale, mean = np.ones((len(x), 1)), np.zeros((len(x), 1))
    if norm == "constant_norm_rescale":
        factor = np.sqrt(D_IN) / np.linalg.norm(x, axis=-1, keepdims=True)
        x, scale = x * factor, 1.0 / factor
    elif norm == "layer_norm":
        mean = x.mean(-1, keepdims=True)
        std = (x - mean).std(-1, keepdims=True, ddof=1)  # torch's std, as SAELens takes it
        x, scale = (x - mean) / (std + 1e-5), std
    if apply_b_dec:
        x = x - w["b_dec"]
    if arch == "gated":
        gate = (x @ w["W_enc"] + w["b_gate"]) > 0
        mag = np.maximum(x @ (w["W_enc"] * np.exp(w["r_mag"].astype(np.float64))) + w["b_mag"], 0)
        return gate * mag, scale, mean
    pre = x @ w["W_enc"] + w["b_enc"]
    if arch == "standard":
        f = np.maximum(pre, 0)
    elif arch == "jumprelu":
        f = np.maximum(pre, 0) * (pre > w["threshold"])
    else:
        f = np.zeros_like(pre)
        top = np.argsort(-pre, axis=-1, kind="stable")[:, :K]
        np.put_along_axis(f, top, np.maximum(np.take_along_axis(pre, top, -1), 0), -1)
    return f, scale, mean


def np_run(name: str, x: np.ndarray):
    """Features, reconstruction and error of rows `x` (float64)."""
    w = weights(name)
    f, scale, mean = np_features(name, x)
    recon = (f @ w["W_dec"] + w["b_dec"]) * scale + mean
    return f, recon, x.reshape(len(x), -1).astype(np.float64) - recon


# Edit cases: name -> (SAE, edit as candlewick.interventions takes it). Built on llama's tiny
# checkpoint; features picked among those that fire on the prompt.
CASES = {
    "steer": ("standard", ("sae_steer", dict(feature=5, scale=3.0))),
    "clamp": ("jumprelu", ("sae_clamp", dict(features=[3, 40], value=2.5))),
    "ablate": ("topk", ("sae_ablate", dict(features="active"))),
    "splice": ("gated", ("sae_splice", dict(keep_error=False))),
    "clamp_scope": ("scope", ("sae_clamp", dict(features=[7], value=-1.0))),
    "clamp_sparsify": ("sparsify", ("sae_clamp", dict(features=[0, 9, 77], value=1.5))),
    "clamp_layernorm": ("layernorm", ("sae_clamp", dict(features=[11, 12], value=3.0))),
    "clamp_heads": ("hookz", ("sae_clamp", dict(features=[2, 5, 60], value=2.0))),
}


def torch_edit(name: str, op: str, args: dict):
    """The edit as a function of a point's rows, in torch (float64 inside, float32 out)."""
    import torch

    w = weights(name)
    w_dec = torch.from_numpy(w["W_dec"]).double()

    def fn(x):
        xd = x.double()
        if op == "sae_steer":
            return (xd + args["scale"] * w_dec[args["feature"]]).to(x.dtype)
        f, scale, mean = np_features(name, xd.numpy())
        f, scale = torch.from_numpy(f), torch.from_numpy(np.asarray(scale, dtype=np.float64))
        if op == "sae_splice":
            mean = torch.from_numpy(np.asarray(mean, dtype=np.float64))
            recon = (f @ w_dec + torch.from_numpy(w["b_dec"]).double()) * scale + mean
            return (recon if not args["keep_error"] else xd).to(x.dtype)
        f2 = f.clone()
        f2[:, args["features"]] = args["value"]
        return (xd + ((f2 - f) @ w_dec) * scale).to(x.dtype)

    return fn


def active_features(name: str, x: np.ndarray, n: int = 3) -> list:
    """The features that fire most often on rows `x`."""
    f = np_features(name, x)[0]
    return [int(i) for i in np.argsort(-(f > 0).sum(0), kind="stable")[:n]]


def main(arch: str = "llama") -> None:
    sys.path.insert(0, str(TINY.parent))
    import generate_interventions as gi
    import torch
    from safetensors.numpy import load_file, save_file

    case_dir = TINY / arch
    model = gi.load(case_dir)
    ids, n_prompt = gi.seq_of(case_dir)
    ref = activations(arch)
    out, cases = {}, {}
    for case, (sae, (op, args)) in CASES.items():
        args = dict(args)
        if args.get("features") == "active":
            args["features"] = active_features(sae, ref[point_of(sae)])
        fn = torch_edit(sae, "sae_clamp" if op == "sae_ablate" else op, {**args, "value": 0.0} if op == "sae_ablate" else args)
        edits = gi.Edits.__new__(gi.Edits)
        edits.hooks = []
        layer = model.model.layers[int(point_of(sae).split(".")[2])]
        what = ".".join(point_of(sae).split(".")[3:])
        if what == "attention.heads":
            edits.hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(gi.Edits.pre(fn)))
        elif what == "input":
            edits.hooks.append(layer.register_forward_pre_hook(lambda _m, a, fn=fn: (fn(a[0][0])[None],) + tuple(a[1:])))
        else:
            src = {"output": layer, "mlp.output": layer.mlp, "attention.output": layer.self_attn}[what]
            edits.hooks.append(src.register_forward_hook(gi.Edits.post(fn)))
        try:
            with torch.no_grad():
                logits = model(torch.tensor(ids)[None], use_cache=False).logits[0].float().numpy().copy()
        finally:
            edits.remove()
        out[f"{case}.sequence_logits"] = logits
        cases[case] = dict(sae=sae, op=op, args=args)
    out["sequence_ids"] = ids.astype(np.int64)
    (DATA / arch).mkdir(parents=True, exist_ok=True)
    save_file(out, str(DATA / arch / "edits.safetensors"))
    meta = dict(reference=f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
                "eager attention, float32, torch hooks", prompt_tokens=int(n_prompt), cases=cases,
                notes="<case>.sequence_logits: logits of every row of sequence_ids (prompt + greedy "
                      "continuation, teacher-forced) with the case's SAE edit at every position")
    (DATA / arch / "edits.json").write_text(json.dumps(meta, indent=1) + "\n")


def saelens_check(arch: str = "llama") -> None:
    """sae-lens's own `SAE.load_from_disk`, `encode` and forward (decode of the encoding) on the
    SAELens files, beside `np_run`, on transformers' activations: the largest differences go to
    tests/data/sae/<arch>/saelens.json (where sae-lens installs into the reference venv)."""
    import tempfile

    import sae_lens
    import torch
    from safetensors.numpy import load_file

    ref = activations(arch)
    paths = materialise(Path(tempfile.mkdtemp()))
    out = {}
    for name, spec in SAES.items():
        if spec[0] != "saelens":
            continue
        sae = sae_lens.SAE.load_from_disk(str(paths[name]), device="cpu")
        x = torch.from_numpy(ref[point_of(name)])  # hook_z as [T, heads, head_dim]: SAELens flattens it
        with torch.no_grad():
            f = sae.encode(x).numpy().reshape(len(x), -1)
            recon = sae.decode(sae.encode(x)).numpy().reshape(len(x), -1)
        want_f, want_r, _ = np_run(name, ref[point_of(name)])
        out[name] = dict(cls=type(sae).__name__, features=float(np.abs(f - want_f).max()),
                         reconstruction=float(np.abs(recon - want_r).max()))
    meta = dict(sae_lens=sae_lens.__version__, max_abs_difference_from_np_run=out)
    (DATA / arch / "saelens.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
    try:
        import sae_lens  # noqa: F401
    except ImportError:
        print("sae-lens is not installed: no saelens.json", file=sys.stderr)
    else:
        saelens_check(*sys.argv[1:])
