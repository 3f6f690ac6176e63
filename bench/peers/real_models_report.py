"""The figures of `python -m bench real-models` side by side: conveyor against each peer that ran and
against the best peer per metric, as a dict for the JSON, a text table and a PNG."""

from __future__ import annotations

from pathlib import Path

GIB = 1024 ** 3
OURS = "conveyor"

# (a system's figure, its label, is higher better)
METRICS = (("load_first_s", "load, first start (s)", False),
           ("load_warm_s", "load, warm start (s)", False),
           ("peak_rss_gib", "peak RSS (GiB)", False),
           ("decode_tok_s", "decode, 1 stream (tok/s)", True),
           ("prompt_ttft_ms", "prompt alone: TTFT (ms)", False),
           ("prompt_tok_s", "prompt alone (tok/s)", True),
           ("batch_output_tok_s", "requests at once: output (tok/s)", True))


def peers_that_ran(systems: dict[str, dict]) -> dict[str, dict]:
    return {name: fig for name, fig in systems.items() if name != OURS and not fig.get("skipped")}


def advantage(ours: float | None, theirs: float | None, higher: bool) -> float | None:
    """conveyor / peer where higher is better, peer / conveyor where lower is: > 1 means conveyor is better."""
    if ours is None or theirs is None:
        return None
    num, den = (ours, theirs) if higher else (theirs, ours)
    return num / den if den else None


def compare(systems: dict[str, dict]) -> dict:
    """Per metric the best peer (highest or lowest value among the peers that ran) and conveyor's ratio
    to it, the ratio to each peer, and how many greedy texts conveyor shares with each peer. Every
    ratio is oriented so that > 1 means conveyor is better."""
    ours, peers = systems.get(OURS, {}), peers_that_ran(systems)
    best: dict[str, dict | None] = {}
    ratios: dict[str, dict[str, float | None]] = {name: {} for name in peers}
    for key, _, higher in METRICS:
        values = {name: fig[key] for name, fig in peers.items() if fig.get(key) is not None}
        for name in peers:
            ratios[name][key] = advantage(ours.get(key), values.get(name), higher)
        if not values:
            best[key] = None
            continue
        name = (max if higher else min)(values, key=values.__getitem__)
        best[key] = {"system": name, "value": values[name], "ratio": advantage(ours.get(key), values[name], higher)}
    agreement = {}
    for name, fig in peers.items():
        if ours.get("greedy_texts") and fig.get("greedy_texts"):
            same = [x == y and x is not None for x, y in zip(ours["greedy_texts"], fig["greedy_texts"])]
            agreement[name] = {"identical": sum(same), "prompts": len(same), "per_prompt": same}
    return {"best_peer": best, "ratios": ratios, "greedy_agreement": agreement}


def table(name: str, file_bytes: int, sizes, systems: dict[str, dict], comparison: dict) -> str:  # noqa: ANN001
    """`sizes`: the run's real_models.Sizes. One column per system that ran, then conveyor's ratio to
    the best peer and that peer's name."""
    shown = {n: fig for n, fig in systems.items() if not fig.get("skipped")}
    width = max([13, *(len(n) + 1 for n in shown)])

    def cell(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    def row(label: str, cells: list[str], tail: str = "") -> str:
        return f"  {label:36s} " + "".join(f"{c:>{width}s}" for c in cells) + tail

    lines = [f"{name} ({file_bytes / GIB:.2f} GiB); ratios > 1: conveyor is better",
             row("", list(shown), f"  {'vs best peer':>12s}  best peer")]
    for key, label, higher in METRICS:
        best = comparison["best_peer"].get(key)
        ratio = best["ratio"] if best else None
        reads = "higher is better: conveyor / peer" if higher else "lower is better: peer / conveyor"
        lines.append(row(label, [cell(fig.get(key)) for fig in shown.values()],
                         f"  {cell(ratio) + 'x' if ratio else '-':>12s}  {best['system'] if best else '-':14s}"
                         f"({reads})"))
    for key, label in (("kv_cache_gib", "KV cache configured (GiB)"), ("memory_budget_gib", "file + KV + 1 GiB")):
        lines.append(row(label, [cell(fig.get(key)) for fig in shown.values()]))
    marks = {True: "yes", False: "NO", None: "-"}
    lines.append(row("peak RSS within file + KV + 1 GiB",
                     [marks[fig.get("memory_within_budget")] for fig in shown.values()]))
    swept = [f"{n} {fig['batch']['best_parallel']}" for n, fig in shown.items()
             if fig.get("batch", {}).get("best_parallel") is not None]
    if swept:
        lines.append(f"  ({sizes.batch_requests} requests at once; best -np of "
                     f"{', '.join(map(str, sizes.llama_parallel))}: {', '.join(swept)})")
    for peer, agreement in comparison.get("greedy_agreement", {}).items():
        lines.append(f"  greedy text (up to {sizes.greedy_tokens} tokens), conveyor and {peer}: identical on "
                     f"{agreement['identical']}/{agreement['prompts']} chat prompts")
    for system, fig in systems.items():
        if fig.get("skipped"):
            lines.append(f"  {system} skipped: {fig['skipped']}")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> str | None:
    """One panel per metric in its own unit; in each, one group of bars per file and one bar per system
    that ran on it, the file's name above conveyor's ratio to the best peer."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for result in results.values():
        names += [n for n, fig in result["systems"].items() if not fig.get("skipped") and n not in names]
    columns = 4
    rows = -(-len(METRICS) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.6 * rows), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, (key, label, higher) in zip(axes.flat, METRICS):
        for i, system in enumerate(names):
            values = [result["systems"].get(system, {}).get(key) for result in results.values()]
            bars = ax.bar([x + i * width for x in range(len(results))],
                          [float("nan") if v is None else v for v in values], width, label=system)
            ax.bar_label(bars, fmt="%.3g", fontsize=6)
        ax.set_title(f"{label}\n({'higher' if higher else 'lower'} is better)", fontsize=8)
        ticks = []
        for file, result in results.items():
            best = result.get("comparison", {}).get("best_peer", {}).get(key)
            ratio = best["ratio"] if best else None
            ticks.append(f"{file}\nconveyor {ratio:.2f}x vs {best['system']}" if ratio else file)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(results))], ticks, fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(METRICS):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    spare = list(axes.flat)[len(METRICS):]
    (spare[0] if spare else fig).legend(handles, labels, loc="center", fontsize=8,
                                        title="ratios > 1: conveyor is better", title_fontsize=7)
    fig.suptitle("conveyor serve and its peers on the same GGUF file")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
