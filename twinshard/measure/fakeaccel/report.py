"""The fake-accelerator run's results as text: one table, then what needs a reader's eye.

``table`` writes a row per configuration, ``details`` the findings of those that are not
``clean``, and ``render`` puts them together; ``check_and_report`` runs the checks and publishes
that (``python -m twinshard.measure.fakeaccel``, ``twinshard bench --backend fakeaccel``). The
columns and what the findings list: docs/fake-accelerator.md, "How to run it".
"""

from __future__ import annotations

from twinshard.commandline.report_files import publish
from twinshard.measure.units import MB, markdown_table

from .runner import run as run_checks


def mesh_label(config: dict) -> str:
    replicas, world = config["replicas"], config["world"]
    return f"{replicas}x{world // replicas}" if replicas > 1 else str(world)


def describe(config: dict) -> str:
    """The configuration in a few words: implementation, mesh and policies."""
    reshard = config["reshard_after_forward"]
    offload = ", offload" if config["offload"] else ""
    return f"{config['impl']} {mesh_label(config)} {config['dtype']}, reshard {reshard}{offload}"


def table(results: list[dict]) -> str:
    head = ["impl", "mesh", "dtype", "offload", "reshard", "host syncs", "explicit", "host colls"]
    head += ["colls", "= CPU", "peak MB", "FSDP MB", "reserved MB"]
    rows = []
    for r in results:
        c = r["config"]
        cells = [c["impl"], mesh_label(c), c["dtype"], "yes" if c["offload"] else "no"]
        cells.append(str(c["reshard_after_forward"]))
        if "steps" not in r:
            rows.append(cells + ["failed"] + ["-"] * 7)
            continue
        last = r["steps"][-1]
        cells += [str(last[k]) for k in ("host_syncs", "explicit_syncs", "host_collectives")]
        cells += [str(last["collectives"]), _same(r)]
        fsdp = sum(last["categories"].values())
        cells += [f"{last['peak_bytes'] / MB:.3f}", f"{fsdp / MB:.3f}", _reserved(r)]
        rows.append(cells)
    return markdown_table(head, rows)


def _same(result: dict) -> str:
    if "cpu_error" in result:
        return "CPU run failed"
    if "collective_difference" not in result:
        return "-"
    return "yes" if result["collective_difference"] is None else "NO"


def _reserved(result: dict) -> str:
    """The caching allocator's reserved peak (``measure.memory``); '-' on a real device."""
    reserved = (result.get("memory") or {}).get("reserved_peak")
    return f"{reserved / MB:.3f}" if reserved is not None else "-"


def details(results: list[dict]) -> str:
    """What the table only counts: every site, difference and failure, per configuration."""
    out = []
    for r in results:
        lines = _findings(r)
        if lines:
            out.append(f"{describe(r['config'])}:\n" + "\n".join(lines))
    return "\n\n".join(out)


def _findings(result: dict) -> list[str]:
    lines = []
    if "error" in result:
        lines.append("  failed on the device:\n" + _indent(result["error"], 4))
    for step in result.get("steps", []):
        for key, title in (
            ("sync_sites", "host sync"),
            ("host_collective_sites", "host tensor in a collective"),
            ("explicit_sites", "explicit sync"),
        ):
            for site in step[key]:
                lines.append(f"  {step['name']}: {title} x{site['count']}: {site['what']}")
                lines += [f"      {frame}" for frame in site["stack"]]
    if result.get("collective_difference"):
        lines.append(f"  collectives differ from the CPU run: {result['collective_difference']}")
    if "cpu_error" in result:
        lines.append("  the CPU run failed:\n" + _indent(result["cpu_error"], 4))
    return lines


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.rstrip().splitlines())


def render(results: list[dict], title: str) -> str:
    """The whole report: title, table, the details."""
    text = title + "\n\n" + table(results)
    found = details(results)
    return text + ("\n\n" + found if found else "\n\nNo host sync, host collective or difference.")


def check_and_report(configs: list, args) -> int:
    """Run ``configs``, print the report (and write it where asked); 1 if any is not clean."""
    results = run_checks(configs, steps=args.steps, cpu=not args.no_cpu, on=args.device)
    first = configs[0]
    cfg = first.llama()
    where = "fake accelerator" if args.device == "fake" else f"device {args.device}"
    title = (
        f"{where}, rank 0 of {mesh_label(first.as_dict())}; Llama {first.preset} (dim "
        f"{cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}), {first.per_rank} x "
        f"{first.seq} tokens per rank; figures of step {args.steps} of {args.steps}"
    )
    text = render(results, title)
    publish(text, args.markdown, args.json, {"title": title, "results": results})
    return 0 if all(clean(r) for r in results) else 1


def clean(result: dict) -> bool:
    """No failure, host sync, host collective or difference from the CPU run in any step."""
    if "error" in result or "cpu_error" in result or result.get("collective_difference"):
        return False
    return all(s["host_syncs"] == 0 and s["host_collectives"] == 0 for s in result["steps"])
