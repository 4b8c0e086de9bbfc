"""`kconvert verify --plot FILE.png`: KLD summary by prompt kind and the per-layer error curve."""

from __future__ import annotations

from kconvert.deps import missing


def plot(rep, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise missing("matplotlib") from None
    fig, axes = plt.subplots(1, 2 if rep.cost.per_layer else 1, figsize=(11 if rep.cost.per_layer else 6, 4), squeeze=False)
    ax = axes[0][0]
    kinds = list(rep.cost.by_kind)
    for q, key in ((0, "mean_kld"), (1, "p99_kld"), (2, "max_kld")):
        ax.bar([i + 0.27 * q for i in range(len(kinds))], [rep.cost.by_kind[k][key] for k in kinds], width=0.27, label=key)
    ax.set_xticks([i + 0.27 for i in range(len(kinds))], kinds)
    ax.set_yscale("log")
    ax.set_title(f"KLD by prompt kind ({rep.scheme}, {rep.verdict})")
    ax.legend()
    if rep.cost.per_layer:
        ax = axes[0][1]
        ax.plot([c["position"] for c in rep.cost.per_layer], [max(c["rel_error"], 1e-12) for c in rep.cost.per_layer], marker="o", label="vs unquantized")
        ax.set_yscale("log")
        ax.set_xlabel("after layer (0 = embeddings)")
        ax.set_title("hidden-state relative error")
        if rep.faithfulness.per_layer:
            ax.plot([c["position"] for c in rep.faithfulness.per_layer],
                    [max(c["rel_error"], 1e-12) for c in rep.faithfulness.per_layer], marker="x", label="vs faithful")
        if rep.first_fault_layer is not None:
            ax.axvline(rep.first_fault_layer + 1, color="red", linestyle="--", label=f"fault: layer {rep.first_fault_layer}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
