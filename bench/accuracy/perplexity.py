"""Perplexity and KL divergence against the float model: conveyor and llama.cpp on the same GGUF file and text.

    python -m bench accuracy --peers-dir /work/peers/llama                       # the bundled Q4_1 file
    python -m bench accuracy --model FILE.gguf --peers-dir DIR [--ctx 512 --chunks 16]

The float reference is `llama-quantize --allow-requantize FILE F32.gguf F32`: the same weights in float32
(bit-exact with conveyor's dequantization). llama.cpp's side is `llama-perplexity` twice: on F32.gguf writing
its log-probs to a base file (`--kl-divergence-base`), then on FILE with `--kl-divergence`. conveyor's side
computes the same windows with its runtime model (the server's loader, kernels, attention path and KV cache
dtype, float32 activations): FILE as served (`--quantization auto`, its own formats) and F32.gguf, full logits
of each window; the first window's NLL is checked against the engine's own prompt_logprobs. Both systems keep
the KV cache in float16 for both files (their defaults beside GGUF weights).

Scoring rule, llama-perplexity's: the tokens are cut into --chunks windows of --ctx tokens (no overlap); with
a BOS-adding vocabulary each window's first token becomes BOS; the second half of each window is scored
(logits at positions ctx/2 .. ctx-2 predict the next token). Both systems score llama.cpp's token ids (read
back from the base file); conveyor's own tokenization of the text is compared with them and reported.
KL(float || quant) is over the full vocabulary on both sides, per scored token, then averaged; llama.cpp
stores the float model's log-probs in 16 bits and skips probabilities below e^-16, conveyor uses float64.

The text: Python's own documentation topics (`pydoc_data.topics`, the text `help()` shows; PSF License
Agreement), in sorted topic order, cut to the first --chunks x --ctx tokens (with a margin).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench import report
from bench.serving import servers

if TYPE_CHECKING:
    import torch

KL_ROWS = 64   # scored rows per log-softmax pass (bounds memory with a 152k vocabulary)


def python_docs_text(num_chars: int) -> str:
    """Python's documentation topics, joined in sorted order (the same text on every machine with this Python)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:num_chars]


def float_gguf(model: Path, quantize: Path, work_dir: Path) -> Path:
    """FILE's weights as an F32 GGUF, made once by llama-quantize and kept in work_dir."""
    out = work_dir / f"{model.stem}.F32.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(quantize), "--allow-requantize", str(model), str(tmp), "F32"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def _figure(pattern: str, log: str) -> float | None:
    """The figure after the last line that starts with `pattern` (the per-chunk table's header names some too)."""
    matches = re.findall(r"^" + pattern + r"\s*[:=]\s*(-?\d[\d.]*)", log, flags=re.MULTILINE)
    return float(matches[-1]) if matches else None


def llama_perplexity(binary: Path, model: Path, text: Path, base: Path, args: argparse.Namespace,
                     kl: bool) -> tuple[dict, float]:
    """One llama-perplexity run; the figures it prints and its seconds. Its log goes beside the results."""
    cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads), "--kl-divergence-base", str(base), *(["--kl-divergence"] if kl else [])]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    log = out.stdout + out.stderr
    args.log_dir.mkdir(parents=True, exist_ok=True)
    (args.log_dir / f"llama-perplexity-{model.stem}{'-kld' if kl else ''}.log").write_text(" ".join(cmd) + "\n" + log)
    if out.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({out.returncode}): {log[-2000:]}")
    if not kl:
        return {"command": cmd, "ppl": _figure(r".*Final estimate: PPL", log)}, elapsed
    return {"command": cmd, "ppl_quant": _figure(r"Mean PPL\(Q\)", log), "ppl_float": _figure(r"Mean PPL\(base\)", log),
            "kl_mean": _figure(r"Mean\s+KLD", log), "kl_median": _figure(r"Median\s+KLD", log),
            "kl_99": _figure(r"99\.0%\s+KLD", log), "same_top_pct": _figure(r"Same top p", log)}, elapsed


def base_tokens(base: Path) -> tuple[int, list[int]]:
    """(n_ctx, token ids) llama-perplexity wrote at the head of a --kl-divergence-base file."""
    with base.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{base} is not a llama-perplexity logits file")
        n_ctx, _, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        return int(n_ctx), np.frombuffer(f.read(4 * int(n_ctx) * int(n_chunk)), dtype=np.int32).tolist()


def windows(ids: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """llama-perplexity's windows: consecutive, non-overlapping, the first token BOS where the vocabulary adds one."""
    out = [list(ids[start:start + ctx]) for start in range(0, len(ids) - ctx + 1, ctx)]
    if bos_id is not None:
        for window in out:
            window[0] = bos_id
    return out


def score_window(quant: torch.Tensor, ref: torch.Tensor, window: list[int]) -> dict[str, float]:
    """Sums over a window's scored half: NLL of the quantized and the float model, KL(float || quant), same argmax."""
    import torch
    from torch.nn import functional as F

    first = len(window) // 2
    targets = torch.tensor(window[first + 1:])
    sums = {"nll_quant": 0.0, "nll_float": 0.0, "kl": 0.0, "same_top": 0.0, "count": 0.0}
    for lo in range(0, len(targets), KL_ROWS):
        rows = slice(first + lo, first + min(lo + KL_ROWS, len(targets)))
        t = targets[lo:lo + KL_ROWS]
        lq = F.log_softmax(quant[rows].double(), dim=-1)
        lf = F.log_softmax(ref[rows].double(), dim=-1)
        sums["nll_quant"] -= lq.gather(1, t[:, None]).sum().item()
        sums["nll_float"] -= lf.gather(1, t[:, None]).sum().item()
        sums["kl"] += (lf.exp() * (lf - lq)).sum().item()
        sums["same_top"] += (lq.argmax(-1) == lf.argmax(-1)).sum().item()
        sums["count"] += len(t)
    return sums


def conveyor_side(model: Path, float_model: Path, parts: list[list[int]], threads: int) -> tuple[dict, float]:
    """Both files through conveyor's loader and runtime model, window by window; full-vocabulary figures."""
    import torch

    from bench.accuracy.quant_accuracy import prefill_logits
    from conveyor import kernels
    from conveyor.model.loader import load_model, resolve_quantization
    from conveyor.runtime.dtype import choose_kv_dtype

    torch.set_num_threads(threads)
    library = kernels.library()
    quantization = resolve_quantization("auto", model, kernel_library=library)
    float_quantization = resolve_quantization("auto", float_model, kernel_library=library)
    quant = load_model(model, kernel_library=library, quantization=quantization)
    ref = load_model(float_model, kernel_library=library, quantization=float_quantization)
    kv_quant = choose_kv_dtype("auto", torch.float32, quantization != "none")[0]
    kv_ref = choose_kv_dtype("auto", torch.float32, float_quantization != "none")[0]
    totals = {"nll_quant": 0.0, "nll_float": 0.0, "kl": 0.0, "same_top": 0.0, "count": 0.0}
    started = time.perf_counter()
    first_window_nll = None
    for window in parts:
        sums = score_window(prefill_logits(quant, window, kv_quant), prefill_logits(ref, window, kv_ref), window)
        first_window_nll = sums["nll_quant"] if first_window_nll is None else first_window_nll
        for key, value in sums.items():
            totals[key] += value
    elapsed = time.perf_counter() - started
    n = totals["count"]
    return {"quantization": quantization, "dtype": "float32", "kv_cache_dtype": [str(kv_quant), str(kv_ref)],
            "ppl_quant": float(np.exp(totals["nll_quant"] / n)),
            "ppl_float": float(np.exp(totals["nll_float"] / n)), "kl_mean": totals["kl"] / n,
            "same_top_pct": 100.0 * totals["same_top"] / n, "scored_tokens": int(n),
            "first_window_nll": first_window_nll}, elapsed


def served_check(model: Path, window: list[int], threads: int) -> float:
    """The first window's scored NLL through the engine API (prompt_logprobs, what the server answers with)."""
    from conveyor import LLM, SamplingParams

    llm = LLM(str(model), threads=threads, dtype="float32")
    out = llm.generate([window], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return -sum(p.logprob for p in out.prompt_logprobs[len(window) // 2 + 1:])


def run(args: argparse.Namespace) -> dict:
    from conveyor.text.gguf_vocab import tokenizer_from_gguf
    from conveyor.model.checkpoint import default_model_path

    model = (args.model or default_model_path()).resolve()
    llama = servers.LlamaCpp.find(args.peers_dir)
    if llama is None:
        raise SystemExit(f"llama.cpp not found under {args.peers_dir}: {servers.BUILD_HINT}")
    binaries = llama.server.parent
    if not (binaries / "llama-perplexity").is_file():
        raise SystemExit(f"{binaries}/llama-perplexity missing: "
                         f"cmake --build {binaries.parent} --target llama-perplexity")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    float_model = float_gguf(model, binaries / "llama-quantize", args.work_dir)
    text = python_docs_text(args.ctx * args.chunks * 8)
    text_path = args.work_dir / "python-docs-topics.txt"
    text_path.write_text(text)
    base = args.work_dir / f"{model.stem}.kld-base.bin"
    print(f"{model.name} vs {float_model.name}; text {text_path} ({len(text)} chars); -c {args.ctx}, "
          f"{args.chunks} chunks, {args.threads} threads", flush=True)

    perplexity = binaries / "llama-perplexity"
    llama_float, llama_float_s = llama_perplexity(perplexity, float_model, text_path, base, args, False)
    llama_kl, llama_kl_s = llama_perplexity(perplexity, model, text_path, base, args, True)
    n_ctx, llama_ids = base_tokens(base)
    base.unlink()   # hundreds of MB of 16-bit log-probs
    tokenizer = tokenizer_from_gguf(model)
    ours = tokenizer.encode(text, add_special_tokens=True)[:len(llama_ids)]
    same = sum(a == b for a, b in zip(ours, llama_ids))
    parts = windows(llama_ids, n_ctx, tokenizer.bos_token_id if tokenizer.add_bos else None)
    print(f"  tokens: llama.cpp {len(llama_ids)}, conveyor's tokenizer agrees on {same} "
          f"({'identical' if same == len(llama_ids) else 'DIFFERENT: scored on llama.cpp ids'})", flush=True)
    conveyor, conveyor_s = conveyor_side(model, float_model, parts, args.threads)
    served_nll = served_check(model, parts[0], args.threads)
    llama_kl["ppl_float_alone"] = llama_float["ppl"]
    rows = {"conveyor": conveyor, "llama.cpp": llama_kl}
    for name, fig in rows.items():
        print(f"  {name:>9}: PPL quant {fig['ppl_quant']:.4f}, PPL float {fig['ppl_float']:.4f}, mean KL(float||quant) "
              f"{fig['kl_mean']:.6f}, same top token {fig['same_top_pct']:.2f} %", flush=True)
    print(f"  window 1's scored NLL: served path (prompt_logprobs) {served_nll:.4f}, runtime model "
          f"{conveyor['first_window_nll']:.4f}", flush=True)
    report.save_run(f"accuracy-{model.stem}", args.out_dir, {
        "model": str(model), "float_model": str(float_model), "threads": args.threads, "ctx": n_ctx,
        "chunks": len(parts), "text": {"source": "pydoc_data.topics (Python's documentation topics, sorted)",
                                      "licence": "PSF License Agreement", "python": sys.version.split()[0],
                                      "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()},
        "tokens": {"llama_cpp": len(llama_ids), "conveyor_tokenizer_agrees": same},
        "kl_vocabulary": "full", "results": rows,
        "seconds": {"llama_float": llama_float_s, "llama_kld": llama_kl_s, "conveyor_both": conveyor_s},
        "served_first_window_nll": served_nll}, llama.commit())
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="a quantized GGUF file (default: the bundled model)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=16, help="windows scored (llama-perplexity --chunks)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR,
                   help="holds llama.cpp/build/bin with llama-perplexity and llama-quantize")
    p.add_argument("--work-dir", type=Path, default=Path("bench/results/accuracy"),
                   help="the F32 GGUF, the text file and llama.cpp's base file go here")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/accuracy"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
