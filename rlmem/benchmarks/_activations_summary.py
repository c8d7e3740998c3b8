"""The figures of ``rlmem bench activations``, formed from its results, and the targets they are checked
against.

At the main model's (``qwen2-2.5b``) largest grid point unless said: ``hidden_offload_efficiency`` = peak
cut of the best rlmem configuration with <= 5% step overhead over ``D2H x (forward + 5% of the step)``;
``best_peak_cut_at_5pct``; ``ckpt_offload_peak_vs_ckpt`` and ``ckpt_offload_overhead_vs_ckpt`` (rlmem's
checkpointing + offload against checkpointing alone); ``full_offload_vs_floor`` at bs 2 x 2048: ``rlmem:all``
over ``max(t_fwd, A / D2H) + max(t_bwd, A / H2D)`` with A the bytes it offloaded, and
``speedup_vs_save_on_cpu_full``. ``rlmem:auto``'s timed steps alternate with steps out of its handle (a
small step drifts by over 10% between blocks of steps measured apart); its overhead is its step over those,
minus 1: ``auto_overhead_max`` over every grid point of every model, ``auto_overhead_small_max`` over the
points where it offloaded under a tenth of the activation bytes (per point in ``auto_points``);
``auto_hidden_min`` over the models at their largest point: the bytes it offloaded over what the link could
move under ``none``'s forward pass (``D2H x forward``); per model in ``auto_by_model``.
``ckpt_offload_peak_vs_ckpt`` and its overhead come from the longest long-context point that ran
(``ckpt_offload_point`` names it; every long point in ``long_points``), else from the largest grid point,
whose own are ``grid_ckpt_offload_peak_vs_ckpt`` and ``grid_ckpt_offload_overhead_vs_ckpt``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO_TARGETS", "TARGETS", "auto_figures", "summarize"]

AUTO_TARGETS = {
    "auto_overhead_max": ("<=", 0.03),
    "auto_overhead_small_max": ("<=", 0.02),
    "auto_hidden_min": (">=", 0.7),
}
TARGETS = {
    "hidden_offload_efficiency": (">=", 0.8),
    "ckpt_offload_peak_vs_ckpt": ("<", 0.85),
    "ckpt_offload_overhead_vs_ckpt": ("<=", 0.05),
    "full_offload_vs_floor": ("<=", 1.2),
    **AUTO_TARGETS,
}


def _size(key: str) -> tuple[int, int]:
    b, s = key.split("x")
    return int(b) * int(s), int(s)


def auto_figures(res: dict[str, Any], links: dict[str, dict[str, float]]) -> dict[str, Any]:
    """``rlmem:auto`` at every grid point of every model: its step over the steps without it (those
    interleaved with its timed steps where measured so, else ``none``'s), minus 1, and the share of the
    activation bytes it offloaded; the worst over all points, the worst where that share is under a tenth,
    and at each model's largest point the share of the link's forward-pass capacity it used."""
    by: dict[str, dict[str, float]] = {}
    points: dict[str, dict[str, dict[str, float]]] = {}
    for m, pts in res.items():
        grid = sorted((k for k in pts if not pts[k].get("long")), key=_size)
        for key in grid:
            none, auto = pts[key].get("none", {}), pts[key].get("rlmem:auto", {})
            ref = auto.get("none_step_s") or none.get("step_s")
            if "step_s" not in auto or not ref:
                continue
            act = auto.get("activation_bytes")
            points.setdefault(m, {})[key] = {
                "overhead": auto["step_s"] / ref - 1,
                "offloaded_share": auto.get("offloaded_bytes", 0) / act if act else None,
                "interleaved": "none_step_s" in auto,
            }
        if not grid or grid[-1] not in points.get(m, {}):
            continue
        big = pts[grid[-1]]
        none, auto = big.get("none", {}), big["rlmem:auto"]
        by[m] = {
            "overhead": points[m][grid[-1]]["overhead"],
            "offloaded_bytes": auto.get("offloaded_bytes", 0),
        }
        if "forward_s" in none:
            cap = links[m]["d2h_bytes_per_s"] * none["forward_s"]
            by[m].update(
                hidden=auto.get("offloaded_bytes", 0) / cap,
                link_forward_bytes=cap,
                # Whether the forward pass is launched ahead of the GPU: where the host's time nears the
                # forward's, every microsecond of the offloader's hooks adds to the step.
                forward_s=none["forward_s"],
                host_forward_none_s=none.get("host_forward_s"),
                host_forward_auto_s=auto.get("host_forward_s"),
            )
    every = [p for m in points.values() for p in m.values()]
    if not every:
        return {}
    out: dict[str, Any] = {"auto_overhead_max": max(p["overhead"] for p in every)}
    small = [p["overhead"] for p in every if p["offloaded_share"] is not None and p["offloaded_share"] < 0.1]
    if small:
        out["auto_overhead_small_max"] = max(small)
    hidden = [v["hidden"] for v in by.values() if "hidden" in v]
    if hidden:
        out["auto_hidden_min"] = min(hidden)
    out.update(auto_by_model=by, auto_points=points)
    return out


def summarize(
    res: dict[str, Any], link: dict[str, float], links: dict[str, dict[str, float]] | None = None
) -> dict[str, Any]:
    main = res.get("qwen2-2.5b")
    out: dict[str, Any] = auto_figures(res, links or dict.fromkeys(res, link))
    if not main:
        return out
    long = [k for k in main if main[k].get("long")]
    pts = sorted((k for k in main if k not in long), key=_size)
    big = main[pts[-1]] if pts else {}
    if "none" not in big:  # only some contenders ran (--only): the grid's figures need the baseline
        return out
    none = big["none"]
    d2h = link["d2h_bytes_per_s"]
    bound = d2h * (none["forward_s"] + 0.05 * none["step_s"])
    best = None
    for k, v in big.items():
        if not k.startswith("rlmem:") or "error" in v or k == "rlmem:ckpt+off":
            continue
        if v["step_s"] <= 1.05 * none["step_s"]:
            cut = none["peak_bytes"] - v["peak_bytes"]
            if best is None or cut > best[1]:
                best = (k, cut)
    if best is not None:
        out["best_config_at_5pct"] = best[0]
        out["hidden_offload_efficiency"] = best[1] / bound
        out["best_peak_cut_at_5pct"] = best[1] / none["peak_bytes"]
    out["link_bound_bytes"] = int(bound)

    # Checkpointing + offload where it is for: the long-context point when it ran (its checkpointed inputs
    # outweigh the gradients); the grid's largest point keeps its own figures beside.
    def ran(key: str) -> bool:
        return all("peak_bytes" in main[key].get(c, {}) for c in ("ckpt", "rlmem:ckpt+off"))

    done = [k for k in long if ran(k)]
    where = max(done, key=_size) if done else pts[-1]
    out["long_points"] = {}
    for k in done:
        ck, cko = main[k]["ckpt"], main[k]["rlmem:ckpt+off"]
        out["long_points"][k] = {
            "ckpt_offload_peak_vs_ckpt": cko["peak_bytes"] / ck["peak_bytes"],
            "ckpt_offload_overhead_vs_ckpt": cko["step_s"] / ck["step_s"] - 1,
            "checkpoint_input_bytes": cko.get("offloaded_bytes", 0),
        }
    for key, prefix in ((pts[-1], "grid_"), (where, "")):
        ck, cko = main[key].get("ckpt", {}), main[key].get("rlmem:ckpt+off", {})
        if "peak_bytes" in ck and "peak_bytes" in cko:
            out[f"{prefix}ckpt_offload_peak_vs_ckpt"] = cko["peak_bytes"] / ck["peak_bytes"]
            out[f"{prefix}ckpt_offload_overhead_vs_ckpt"] = cko["step_s"] / ck["step_s"] - 1
    out["ckpt_offload_point"] = where
    mid = main.get("2x2048")
    if mid and "offloaded_bytes" in mid.get("rlmem:all", {}):
        n, a = mid["none"], mid["rlmem:all"]
        t_fwd, t_bwd = n["forward_s"], n["step_s"] - n["forward_s"]
        nbytes = a["offloaded_bytes"]
        floor = max(t_fwd, nbytes / d2h) + max(t_bwd, nbytes / link["h2d_bytes_per_s"])
        out["full_offload_vs_floor"] = a["step_s"] / floor
        if "step_s" in mid.get("save_on_cpu", {}):
            out["speedup_vs_save_on_cpu_full"] = mid["save_on_cpu"]["step_s"] / a["step_s"]
    return out
