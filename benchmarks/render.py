"""``python -m benchmarks.render RESULT.json``: print a result file of ``benchmarks/results/`` as a markdown
table (the tables of docs/convergence.md and docs/bench-*.md are pasted from this output, with the command and
machine the file records)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def codecs(d: dict) -> list[str]:
    eager = any(r.get("eager_encode_gbps") is not None for r in d["rows"])
    profiled = any(r.get("encode_kernels") is not None for r in d["rows"])
    extra = " eager encode GB/s | eager decode GB/s | fused gain enc / dec |" if eager else ""
    extra += " device ops enc / dec | device µs enc / dec |" if profiled else ""
    learning = any(r.get("learning_encode_gbps") is not None for r in d["rows"])
    extra += " encode in training GB/s (/ clone) |" if learning else ""
    out = ["| codec | encode GB/s | decode GB/s | clone GB/s | encode / clone | decode / clone |" + extra
           + " wire bytes | ratio |", "|---|---|---|---|---|---|" + ("---|---|---|" if eager else "")
           + ("---|---|" if profiled else "") + ("---|" if learning else "") + "---|---|"]
    for r in d["rows"]:
        cells = ""
        if eager:
            cells = (f" {r['eager_encode_gbps']:.2f} | {r['eager_decode_gbps']:.2f} | "
                     f"{r['encode_gbps'] / r['eager_encode_gbps']:.1f}x / "
                     f"{r['decode_gbps'] / r['eager_decode_gbps']:.1f}x |")
        if profiled:
            cells += (f" {r['encode_kernels']} / {r['decode_kernels']} | "
                      f"{r['encode_kernel_us']:.0f} / {r['decode_kernel_us']:.0f} |")
        if learning:
            rate = r.get("learning_encode_gbps")
            cells += f" {rate:.2f} ({rate / r['clone_gbps']:.2f}) |" if rate is not None else " |"
        out.append(f"| `{r['codec']}` | {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | "
                   f"{r['clone_gbps']:.1f} | {r['encode_vs_clone']:.2f} | "
                   f"{r['decode_vs_clone']:.2f} |{cells} {r['wire_bytes']:,} | {r['ratio']:.1f}x |")
    return out


def codecs_cache_path(d: dict) -> list[str]:
    """``aqsgd bench codecs --cache-path``: the AQ-SGD cache path and, with a disk cache, its prefetch
    table."""
    from aqsgd.bench.cachepath import markdown_table

    return markdown_table(d)


def pipeline(d: dict) -> list[str]:
    out = ["| stages | D | grad sync | Mbit/s | setting | samples/s | speed-up vs fp32 | ideal | efficiency "
           "| vs pipeline-only | fp32 comm:compute |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        dp = r.get("data_parallel", 1)
        vs = r.get("speedup_vs_pipeline_only")
        out.append(f"| {r['stages']} | {dp} | {r.get('grad_sync', '-') if dp > 1 else '-'} | "
                   f"{r['bandwidth_mbps']:g} | {r['setting']} | {r['samples_per_s']:.1f} | "
                   f"{r['speedup_vs_fp32']:.2f}x | {r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} | "
                   f"{'-' if vs is None else f'{vs:.2f}x'} | {r['comm_compute_ratio']:.2f} |")
    return out


def convergence(d: dict) -> list[str]:
    out = ["| setting | forward | backward | final train loss | metric | eval, compression on | "
           "eval, compression off | on vs fp32 | off vs fp32 | best eval, off | best vs fp32's best | "
           "traffic ratio |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    from aqsgd.bench.convergence import format_relative as pct, study_table

    for r in study_table(d):  # recomputed from the runs, so files written before a column existed have it too
        out.append(f"| {r['setting']} | `{r['forward']}` | `{r['backward']}` | "
                   f"{_fmt(r['final_train_loss'], '.4f')} | {r['metric']} | {_fmt(r['eval_on'], '.4f')} | "
                   f"{_fmt(r['eval_off'], '.4f')} | {pct(r['rel_vs_fp32'], r['rel_vs_fp32_std'])} | "
                   f"{pct(r['rel_off_vs_fp32'], r['rel_off_vs_fp32_std'])} | {_fmt(r['best_off'], '.4f')} | "
                   f"{pct(r['rel_best_off_vs_fp32'], r['rel_best_off_vs_fp32_std'])} | "
                   f"{_fmt(r['compression_ratio'])}x |")
    return out


def netem(d: dict) -> list[str]:
    from aqsgd.bench.netem import markdown_table

    return markdown_table(d["rows"]).splitlines()


def boundary_errors(d: dict) -> list[str]:
    from benchmarks.boundary_errors import markdown_table

    return markdown_table(d)


def codec_quality_specs(d: dict) -> list[str]:
    """``aqsgd bench codecs --quality --codecs SPEC...``: per data source, each codec's measured bits per
    value and relative error on each kind of boundary tensor (means over the source's boundaries)."""
    kinds = list(dict.fromkeys(r["tensor"] for r in d["rows"]))
    out: list[str] = []
    for source in dict.fromkeys(r["source"] for r in d["rows"]):
        cells = {(r["spec"], r["tensor"]): r for r in d["rows"] if r["source"] == source}
        if out:
            out.append("")
        out += [f"{source}:", "", "| codec | " + " | ".join(f"{k}: bits/value | error" for k in kinds) + " |",
                "|---|" + "---|---|" * len(kinds)]
        for spec in dict.fromkeys(sp for sp, _ in cells):
            row = [f"{cells[spec, k]['bits_per_value']:.2f} | {cells[spec, k]['rel_mse']:.3g}"
                   if (spec, k) in cells
                   else "- | -" for k in kinds]
            out.append(f"| `{spec}` | " + " | ".join(row) + " |")
    return out


def codecs_quality(d: dict) -> list[str]:
    """``aqsgd bench codecs --quality``: one table per source and tensor, error at b = 1..8 (bold: worse than
    sending zeros), as in docs/bench-codecs.md."""
    bits = d["bits"]
    out: list[str] = []
    for panel in dict.fromkeys((r["source"], r["tensor"]) for r in d["rows"]):
        if out:
            out.append("")
        out += [f"{panel[0]} {panel[1]}:", "", "| `q<b>` options | scale bits/value | "
                + " | ".join(f"b = {b}" for b in bits) + " |", "|---|---|" + "---|" * len(bits)]
        for r in (r for r in d["rows"] if (r["source"], r["tensor"]) == panel):
            label = r["label"] if r["kind"] == "reference" or r["label"] == "default" else f"`{r['label']}`"
            errors = ["-" if e is None else f"**{e:.3g}**" if r["kind"] == "codec" and e > 1 else f"{e:.3g}"
                      for e in r["rel_mse"]]
            out.append(f"| {label} | {_fmt(r['scale_bits'], '.3g')} | " + " | ".join(errors) + " |")
    return out


def vs_torch(d: dict) -> list[str]:
    """``aqsgd bench vs-torch``: samples/s against torch.distributed.pipelining, then one message's
    latency."""
    out = ["| stages | schedule | aqsgd samples/s | torch samples/s | aqsgd / torch | first-step loss |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        loss = f"{r['aqsgd_first_loss']:.6f}"
        if r["torch_first_loss"] != r["aqsgd_first_loss"]:
            loss += f" vs {r['torch_first_loss']:.6f}"
        out.append(f"| {r['stages']} | {r['torch_schedule']} | {r['aqsgd_samples_per_s']:.1f} | "
                   f"{r['torch_samples_per_s']:.1f} | {r['ratio']:.2f}x | {loss} |")
    if d.get("latency"):
        out += ["", ("| payload bytes | hand-over ms, aqsgd / torch | CRC off | ping-pong ms, aqsgd / torch "
                     "| CRC off |"),
                "|---|---|---|---|---|"]
        for r in d["latency"]:
            out.append(f"| {r['payload_bytes']:,} | {r['aqsgd_handover_ms']:.3f} / "
                       f"{r['torch_handover_ms']:.3f} ({r['handover_ratio']:.2f}x) | "
                       f"{r['aqsgd_nocrc_handover_ms']:.3f} ({r['handover_ratio_nocrc']:.2f}x) | "
                       f"{r['aqsgd_pingpong_ms']:.3f} / {r['torch_pingpong_ms']:.3f} "
                       f"({r['pingpong_ratio']:.2f}x) | {r['aqsgd_nocrc_pingpong_ms']:.3f} "
                       f"({r['pingpong_ratio_nocrc']:.2f}x) |")
    return out


def overhead(d: dict) -> list[str]:
    """``aqsgd bench overhead``: the local pipeline's step time next to a plain transformers loop."""
    out = [f"{d['parameters'] / 1e6:.1f} M parameters, {d['dtype']}, {d['device']}", "",
           "| system | stages | step ms | samples/s | plain / this | first-step loss |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        stages = "" if r["stages"] is None else r["stages"]
        out.append(f"| {r['system']} | {stages} | {1e3 * r['step_s']:.1f} | {r['samples_per_s']:.1f} | "
                   f"{r['ratio']:.3f} | {r['first_loss']:.6f} |")
    return out


def adaptive(d: dict) -> list[str]:
    scenarios = d["scenarios"]
    names = list(scenarios)
    head = " | ".join(f"`{n}` to target | median step | perplexity vs fp32" for n in names)
    out = [f"| setting | {head} |", "|---|" + "---|---|---|" * len(names)]
    for i, r in enumerate(scenarios[names[0]]["runs"]):
        cells = []
        for n in names:
            run = scenarios[n]["runs"][i]
            t, rel, med = run["time_to_target_s"], run["perplexity_vs_fp32"], run["median_step_s"]
            failed = f" (failed at step {len(run['loss']) + 1})" if run.get("error") else ""
            cells += [(f"{t:.2f} s" if t is not None else "never") + failed,
                      "-" if med is None else f"{med:.3f} s", "-" if rel is None else f"{100 * rel:+.2f} %"]
        out.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    out.append("")
    out += [f"`{n}`: links {s['link']}, target loss {s['target_loss']:.4f} (fp32 at step "
            f"{s['target_at_step']}), best fixed: {s['best_fixed']}" for n, s in scenarios.items()]
    return out


def balance_measured(d: dict) -> list[str]:
    out = ["| split | step (ms, median over rounds) |", "|---|---|"]
    for name, r in sorted(d["splits"].items(), key=lambda kv: kv[1]["step_ms"]):
        out.append(f"| {name} | {r['step_ms']:.1f} |")
    m = d["measured"]
    out.append(f"| **measured: {','.join(map(str, m['layers']))}** | **{m['step_ms']:.1f}** |")
    out += ["", f"stage {d['emulate_slow_stage']} (stage:factor) emulated slower; measured / best "
            f"({d['best_split']}): {d['measured_over_best']:.3f} (target {d['target']}); even split "
            f"{d['even_split']}: {d['even_ms'] / d['best_ms']:.3f} of the best"]
    return out


def batching(d: dict) -> list[str]:
    out = ["| runtime | batching | real tokens/s | speed-up | boundary bytes per real token | at fp32 | "
           "pad tokens sent |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        out.append(f"| {r['runtime']} | {r['batching']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                   f"{r['bytes_per_token']:,.0f} | {r['fp32_bytes_per_token']:,.0f} | "
                   f"{r['pad_tokens_sent']:,} |")
    return out


def gpu_check(d: dict) -> list[str]:
    """``python -m benchmarks.gpu_check run``'s report (``gpu-check.json``): the markdown the check writes."""
    from benchmarks.gpu_check import markdown

    return markdown(d).rstrip("\n").splitlines()


def projection_roofline(d: dict) -> list[str]:
    from benchmarks.projection_roofline import table

    return table(d)


def diloco_netem(d: dict) -> list[str]:
    from benchmarks.diloco_netem import table

    return table(d)


RENDERERS = {"codecs": codecs, "codecs-cache-path": codecs_cache_path, "codecs-quality": codecs_quality,
             "codecs-quality-specs": codec_quality_specs, "pipeline": pipeline, "convergence": convergence,
             "netem": netem, "boundary_errors": boundary_errors, "vs-torch": vs_torch, "overhead": overhead,
             "adaptive": adaptive, "balance-measured": balance_measured, "gpu-check": gpu_check,
             "batching": batching, "diloco-netem": diloco_netem, "projection-roofline": projection_roofline}


def main(paths: list[str]) -> int:
    for p in paths:
        d = json.loads(Path(p).read_text())
        kind = (d.get("benchmark") or ("convergence" if "table" in d else None)
                or ("gpu-check" if d.get("check") == "gpu" else None))
        if kind not in RENDERERS:
            print(f"render: {p} holds a {kind!r} result, which has no table here (known: "
                  f"{', '.join(sorted(RENDERERS))})", file=sys.stderr)
            return 2
        lines = RENDERERS[kind](d)
        commands = d.get("commands") or [d.get("command") or ("python3 -m benchmarks.gpu_check run"
                                                              if kind == "gpu-check" else "")]
        machine = d.get("machine") or d.get("env", {}).get("gpu") or ""
        print(f"<!-- {p}: {' ; '.join(commands)} on {machine} -->")
        print("\n".join(lines))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
