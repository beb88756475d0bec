#!/usr/bin/env python3
"""`make bench-forward`: dsv4's CPU forward pass against Hugging Face transformers on the same
weights, in one run. Runs examples/bench_forward (dsv4) on the flash-like fixture and on a larger
random model (hidden 1024, 8 layers, every layer kind), then — when torch and transformers 5.23
are importable — transformers on the same checkpoints with the same prompts, thread count and
decode steps, and prints the ratios. Each model prints

    (ratios decode_b1_vs_hf=X decode_b8_vs_hf=Y prefill_vs_hf=Z decode_b8_vs_b1=W)

with fp32 weights on both sides (HF ratios are `n/a` without torch); the large model also with
dsv4's bf16 weights. Then the large model written as an official FP8/FP4 checkpoint (the same
weights rounded): dsv4 with its weights native against transformers on the dequantised copy,
and the fraction of the machine's read bandwidth a decode step reaches. The last line is

    ratios(native) decode_b1_vs_hf=X decode_b8_vs_hf=Y prefill_vs_hf=Z bw_fraction=F

`--only-native` runs that last part alone. DSV4_BENCH_BIN names the bench_forward binary to run
(default: cargo's build of it) and DSV4_BENCH_DIR where it writes the models: a machine with the
built binary and no Rust (scripts/gpu-check.sh on the GPU machine) runs it that way.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where `make bench-forward` built it: cargo's CARGO_TARGET_DIR when set (as the Makefile honours).
EXAMPLE = Path(os.environ.get("DSV4_BENCH_BIN") or
               Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target") / "release" / "examples" / "bench_forward")


def dsv4(model, threads, weights="f32", bandwidth=False):
    out = subprocess.run([str(EXAMPLE), "--model", model, "--threads", str(threads),
                          "--weights", weights, "--json"] + (["--bandwidth"] if bandwidth else []),
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def hf_model(checkpoint):
    """transformers' DeepseekV4ForCausalLM with the checkpoint's weights (either naming)."""
    import numpy as np
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    from make_fixtures import HF_BLOCK, HF_TOP

    config_json = json.loads((checkpoint / "config.json").read_text())
    fields = {k: v for k, v in config_json.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = DeepseekV4Config(**fields)
    config._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).float().eval()
    import safetensors.numpy
    stored = safetensors.numpy.load_file(str(checkpoint / "model.safetensors"))
    if any(name.startswith("model.") for name in stored):
        state = {k: torch.from_numpy(v) for k, v in stored.items()}
    else:
        state, inter = {}, config.moe_intermediate_size
        experts = {}
        for name, value in stored.items():
            if name.startswith("mtp."):
                continue
            if name in HF_TOP:
                state[HF_TOP[name]] = torch.from_numpy(value)
                continue
            layer, rest = name[len("layers."):].split(".", 1)
            if ".experts." in rest:
                x, part = rest[len("ffn.experts."):].split(".", 1)
                experts.setdefault(int(layer), {})[(int(x), part)] = value
                continue
            state[f"model.layers.{layer}.{HF_BLOCK[rest]}"] = torch.from_numpy(value)
        for layer, parts in experts.items():
            n = config.n_routed_experts
            gate_up = np.stack([np.concatenate([parts[(e, "w1.weight")], parts[(e, "w3.weight")]]) for e in range(n)])
            down = np.stack([parts[(e, "w2.weight")] for e in range(n)])
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(gate_up)
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.from_numpy(down)
    model.load_state_dict(state)
    return model


def tokens(vocab, seed, n):
    import numpy as np
    return np.random.default_rng(seed).integers(2, vocab, size=n).tolist()


def hf(report):
    """The same measurements as examples/bench_forward, with transformers: best of 5 prefills,
    decode from the median step time."""
    import torch
    torch.set_num_threads(report["threads"])
    model = hf_model(Path(report["checkpoint"]))
    vocab, prompt, steps = model.config.vocab_size, report["prompt"], report["decode_steps"]
    with torch.no_grad():
        ids = torch.tensor([tokens(vocab, 1, prompt)])
        best = 0.0
        for _ in range(5):
            t = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            best = max(best, prompt / (time.perf_counter() - t))
        rates = {}
        for batch in (1, 8):
            ids = torch.tensor([tokens(vocab, 10 + i, prompt) for i in range(batch)])
            out = model(ids, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            nxt = torch.tensor([tokens(vocab, 100 + i, steps) for i in range(batch)])
            times = []
            for step in range(steps):
                t = time.perf_counter()
                out = model(nxt[:, step:step + 1], past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                times.append(time.perf_counter() - t)
            rates[batch] = batch / sorted(times)[len(times) // 2]
    return {"prefill_tok_s": best, "decode_b1_tok_s": rates[1], "decode_b8_tok_s": rates[8]}


def main():
    threads = int(os.environ.get("DSV4_BENCH_THREADS", "0")) or os.cpu_count() or 1
    try:
        import numpy  # noqa: F401
        import safetensors  # noqa: F401
        import torch  # noqa: F401
        import transformers
        have_hf = transformers.__version__ == "5.23.0"
        why = "" if have_hf else f"transformers {transformers.__version__} (need 5.23.0)"
    except ImportError as e:
        have_hf, why = False, f"{e.name} not installed"
    fmt = lambda r: (f"prefill {r['prefill_tok_s']:9.1f} tok/s   decode b1 {r['decode_b1_tok_s']:8.1f} "
                     f"tok/s   decode b8 {r['decode_b8_tok_s']:8.1f} tok/s")
    def transformers(report):
        """transformers on `report`'s checkpoint (printed), or None when it cannot run here."""
        theirs = hf(report) if have_hf else None
        if theirs:
            print(f"  transformers (f32)  {fmt(theirs)}")
        else:
            print(f"  transformers        skipped: {why}")
        return theirs

    for model in () if "--only-native" in sys.argv[1:] else ("fixture", "large"):
        ours = dsv4(model, threads)
        print(f"{model}: {ours['prompt']}-token prompt, {ours['decode_steps']} decode steps, "
              f"{ours['threads']} threads")
        print(f"  dsv4 (f32)          {fmt(ours)}")
        theirs = transformers(ours)

        def ratios(mine):
            r = (lambda k: f"{mine[k] / theirs[k]:.2f}") if theirs else (lambda k: "n/a")
            return (f"ratios decode_b1_vs_hf={r('decode_b1_tok_s')} decode_b8_vs_hf={r('decode_b8_tok_s')} "
                    f"prefill_vs_hf={r('prefill_tok_s')} "
                    f"decode_b8_vs_b1={mine['decode_b8_tok_s'] / mine['decode_b1_tok_s']:.2f}")

        if model == "large":
            bf16 = dsv4(model, threads, "bf16")
            print(f"  dsv4 (bf16)         {fmt(bf16)}")
            print(f"  (bf16 weights: {ratios(bf16)})")
        print(f"  ({ratios(ours)})")
    # The large model as an official FP8/FP4 checkpoint (the same weights rounded): dsv4 keeps
    # it native (`model.weight_dtype = auto`); dsv4 f32 and transformers load the dequantised
    # copy. The bandwidth fraction: weight bytes a decode step reads (only the experts that
    # fired) / step time / this machine's measured read bandwidth (same threads; the best of a
    # plain read before and after the model runs).
    native = dsv4("large-fp8", threads, "auto", bandwidth=True)
    same = dsv4("large-fp8-deq", threads, "f32")
    print(f"large-fp8: {native['prompt']}-token prompt, {native['decode_steps']} decode steps, "
          f"{native['threads']} threads; resident weight bytes {native['resident_bytes']}")
    print(f"  dsv4 (native)       {fmt(native)}")
    print(f"  dsv4 (f32, same weights) {fmt(same)}")
    theirs = transformers(same)
    bw = native["read_bandwidth"]
    samples = " / ".join(f"{b / 1e9:.1f}" for b in native["read_bandwidth_samples"])
    print(f"  a b1 decode step reads {native['step_bytes_b1'] / 1e6:.1f} MB of weights, b8 "
          f"{native['step_bytes_b8'] / 1e6:.1f} MB; read bandwidth {bw / 1e9:.1f} GB/s (best of "
          f"before / after the runs: {samples}); fraction reached b1 "
          f"{native['bw_fraction_b1']:.2f}, b8 {native['bw_fraction_b8']:.2f}")
    kernels = ", ".join(f"{name} {f:.2f}" for name, f in native["kernel_bw_fraction"].items())
    print(f"  batch-1 matrix-vector kernels alone (8192 x 4096, bytes read / read bandwidth): {kernels}")
    if native.get("amx"):
        print(f"  prefill on AMX tiles (inputs split into three bf16 parts): "
              f"{native['prefill_tok_s']:.1f} tok/s; the same binary with them off "
              f"{native['prefill_no_amx_tok_s']:.1f} tok/s "
              f"({native['prefill_tok_s'] / native['prefill_no_amx_tok_s']:.2f}x)")
        if native.get("decode_b8_no_amx_tok_s"):
            print(f"  decode b8 with its narrow products (256-512 columns) on AMX tiles: "
                  f"{native['decode_b8_tok_s']:.1f} tok/s; the same binary with them off "
                  f"{native['decode_b8_no_amx_tok_s']:.1f} tok/s "
                  f"({native['decode_b8_tok_s'] / native['decode_b8_no_amx_tok_s']:.2f}x)")
    else:
        print("  prefill: no AMX tiles on this CPU (or DSV4_CPU_AMX=0): f32 kernels")
    vs_f32 = lambda k: f"{native[k] / same[k]:.2f}"
    print(f"  native vs dsv4 f32: decode b1 {vs_f32('decode_b1_tok_s')}x, decode b8 "
          f"{vs_f32('decode_b8_tok_s')}x, prefill {vs_f32('prefill_tok_s')}x")
    r = (lambda k: f"{native[k] / theirs[k]:.2f}") if theirs else (lambda k: "n/a")
    print(f"ratios(native) decode_b1_vs_hf={r('decode_b1_tok_s')} decode_b8_vs_hf={r('decode_b8_tok_s')} "
          f"prefill_vs_hf={r('prefill_tok_s')} bw_fraction={native['bw_fraction_b1']:.2f}")


if __name__ == "__main__":
    main()
