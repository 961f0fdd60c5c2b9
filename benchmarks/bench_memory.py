"""Resident memory of a served GGUF model, one fresh process per system, all in one run: what loading the
model and generating one answer add to the process, and the peak.

Systems (per model; SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M by default):
  inflight           LLM(model): the default ("auto": int16 activations into the GEMMs on an AVX512-VNNI CPU;
                     the layers then hold only the GEMM's packed weights)
  inflight-both      the same, every packed layer told to keep its checkpoint tensors too
                     (``set_packed_only(False)``): the weights twice, as before stop 43
  inflight-fp32act   activation_quantization="none": the float kernels read the checkpoint tensors
  inflight-int8      activation_quantization="int8"
  inflight-baseline  with --baseline DIR: the default from the inflight package in DIR (an earlier commit)
  llama.cpp          the same file through llama-cpp-python's C API (when llama_cpp is importable), a
                     context of --kv-tokens tokens
  transformers       AutoModelForCausalLM from the same GGUF (dequantised to fp32), with --transformers

Each system runs in its own process: resident set size (RSS, /proc) after its imports, after loading the
model (for inflight: LLM(...) with a KV pool of --kv-tokens tokens), and after generating --max-tokens
greedy tokens for one chat prompt (tokenised by the parent, so a child loads no tokenizer but its system's
own: inflight's engine holds one, llama.cpp its vocabulary, and the transformers child loads the one a
transformers user would); "model" = after generating minus after the imports (what the system
adds), "peak" = the process's maximum RSS (ru_maxrss; the GGUF file's mapped pages count while read).
inflight's "weights held" = every tensor the model holds plus every packed kernel copy.

    python benchmarks/bench_memory.py [--models smollm2,gemma3-270m] [--max-tokens 32] [--kv-tokens 4096]
        [--skip-llamacpp] [--transformers] [--baseline DIR] [--out FILE]   (default: docs/bench/memory-<cpu>-cpu.json)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

SYSTEMS = ("inflight", "inflight-both", "inflight-fp32act", "inflight-int8", "llama.cpp", "transformers")
_ACT = {"inflight": None, "inflight-both": None, "inflight-fp32act": "none", "inflight-int8": "int8"}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def weights_held(model) -> int:
    """Bytes of every tensor the model holds (unique storages) plus every packed kernel copy."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for m in model.modules():
        packed = getattr(m, "_packed", None)
        total += getattr(packed, "nbytes", 0) or 0
    return total


def chat_ids(model: str) -> list[int]:
    """The chat prompt's token ids (as benchmarks/bench_decode_cpu.py builds them)."""
    from bench_decode_cpu import CHAT

    from inflight.models.gguf_loader import resolve_known_model
    from inflight.models.gguf_tokenizer import GEMMA_CHAT_TEMPLATE, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(resolve_known_model(model))
    template = None if tokenizer.chat_template else GEMMA_CHAT_TEMPLATE  # Gemma's file has none
    text = tokenizer.apply_chat_template(
        CHAT, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def child(system: str, model: str, max_tokens: int, kv_tokens: int, prompt: list[int]) -> dict:
    out: dict = {"system": system, "model": model}
    if system.startswith("inflight"):
        import inflight  # noqa: F401 (its imports count as the baseline)
        from inflight import LLM, KvCacheConfig, SamplingParams

        out["rss_imports"] = rss_mib()
        kv = KvCacheConfig(max_tokens=kv_tokens)
        llm = LLM(model, activation_quantization=_ACT.get(system), kv_cache_config=kv)
        net = llm.executor.model_engine.model
        if system == "inflight-both":
            for m in net.modules():
                if hasattr(m, "set_packed_only"):
                    m.set_packed_only(False)
                    if m.activation_quantization != "none":
                        m.kernel_weight()
            net.invalidate_fused_layers()
        out["rss_loaded"] = rss_mib()
        out["weights_held_mib"] = weights_held(net) / 2**20
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        llm.generate(prompt, params, use_tqdm=False)
        out["rss_after"] = rss_mib()
        llm.shutdown()
    elif system == "llama.cpp":
        from bench_decode_cpu import LlamaCppRunner

        from inflight.models.gguf_loader import resolve_known_model

        path = resolve_known_model(model)
        out["rss_imports"] = rss_mib()
        runner = LlamaCppRunner(path, threads=os.cpu_count() or 1, max_len=kv_tokens)
        runner._use_context(1)
        out["rss_loaded"] = rss_mib()
        runner.single(prompt, max_tokens)
        out["rss_after"] = rss_mib()
        runner.close()
    elif system == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        from inflight.models.gguf_loader import resolve_known_model
        from inflight.models.gguf_tokenizer import load_gguf_tokenizer

        path = resolve_known_model(model)
        out["rss_imports"] = rss_mib()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
        tokenizer = load_gguf_tokenizer(path)  # what a transformers user loads beside the model
        out["rss_loaded"] = rss_mib()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        out["text_chars"] = len(tokenizer.decode(gen[0, ids.shape[1] :]))
        out["rss_after"] = rss_mib()
    else:
        raise ValueError(f"unknown system {system!r}")
    out["peak"] = peak_mib()
    out["model_mib"] = out["rss_after"] - out["rss_imports"]
    return out


def _run_child(args: list[str], tag: str, env) -> str:
    """Runs this script with ``args`` in a fresh process; returns its output line after ``tag``."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(tag)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    return line[len(tag) :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--transformers", action="store_true", help="also the fp32 transformers model")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run the default from the inflight package in DIR (e.g. an earlier commit's python/ "
        "with its built _C module), as the system inflight-baseline",
    )
    p.add_argument("--child", nargs=2, metavar=("SYSTEM", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompt-of", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.prompt_of:
        print("PROMPT " + ",".join(map(str, chat_ids(a.prompt_of))))
        return
    if a.child:
        prompt = [int(x) for x in a.prompt_ids.split(",")]
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], a.max_tokens, a.kv_tokens, prompt)))
        return

    import importlib.util

    from bench_common import cpu_header, cpu_tag
    from tqdm import tqdm

    from inflight.ops import cpu_info

    systems = [
        s
        for s in SYSTEMS
        if not (s == "llama.cpp" and (a.skip_llamacpp or importlib.util.find_spec("llama_cpp") is None))
        and not (s == "transformers" and not a.transformers)
    ]
    if a.baseline:
        systems.insert(1, "inflight-baseline")
    header = cpu_header()
    print(header)
    models = a.models.split(",")
    # The prompt is tokenised once per model, in a process of its own: no system's child loads a tokenizer
    # it would not need, and this process stays small (a child's ru_maxrss starts at its parent's RSS,
    # which Linux keeps across exec).
    prompts = {m: _run_child(["--prompt-of", m], "PROMPT ", os.environ) for m in models}
    runs = [(m, s) for m in models for s in systems]
    results = []
    for model, system in tqdm(runs, desc="systems", unit="process"):
        cmd = ["--child", system, model, "--prompt-ids", prompts[model]]
        cmd += ["--max-tokens", str(a.max_tokens), "--kv-tokens", str(a.kv_tokens)]
        env = dict(os.environ)
        if system == "inflight-baseline":
            env["PYTHONPATH"] = os.pathsep.join([a.baseline, *filter(None, [env.get("PYTHONPATH")])])
        results.append(json.loads(_run_child(cmd, "RESULT ", env)))

    print(f"\nResident memory, MiB (KV pool / context {a.kv_tokens} tokens, {a.max_tokens} generated tokens)")
    print(
        f"{'model':<13} {'system':<17} {'imports':>8} {'loaded':>8} {'after':>8} {'model':>8} {'peak':>8} {'held':>8}"
    )
    for r in results:
        held = f"{r['weights_held_mib']:8.1f}" if "weights_held_mib" in r else f"{'-':>8}"
        print(
            f"{r['model']:<13} {r['system']:<17} {r['rss_imports']:8.0f} {r['rss_loaded']:8.0f} "
            f"{r['rss_after']:8.0f} {r['model_mib']:8.0f} {r['peak']:8.0f} {held}"
        )
    default = f"memory-{cpu_tag(cpu_info()['model'])}-cpu.json"
    out = Path(a.out) if a.out else Path(__file__).resolve().parent.parent / "docs" / "bench" / default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"header": header, "kv_tokens": a.kv_tokens, "results": results}, indent=1) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
