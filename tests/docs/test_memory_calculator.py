"""The memory calculator (docs/memory.md): its numbers are ``twinshard plan``'s, and the page
shows them.

The page's data is the committed ``docs/memory/plans.json`` that
``benchmarks/memory_calculator.py`` records. One setting is recorded again as that script
records it, and must give the data to the byte: when the planner's memory moves, this fails and
names the command that records the data again. In the full tier three more settings are
planned at the model's full depth by the planner's own function (``plan.cli.plan``, what the
command runs, without the ideal step, which has no memory of its own), from the command line
the page prints for each: every part of the peak, the peak and its place must be equal to the
byte, which checks the depth line the script continues most settings by. The line's own rules
(which peaks it continues, which it refuses) are checked on made-up records, and the build's
refusal of missing data without building. The last tests show the built page in Chromium at
420 and 1400 pixels.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.parse

import pytest
from benchmark_scripts import load
from docs_site import ROOT, load_hook, probe

from twinshard.measure.plan import cli as plan_cli
from twinshard.measure.plan.trace import PARTS

memory = load("memory_calculator")  # the script that records the page's data
depth = load("memory_depth")  # the depth line it continues
DATA = ROOT / "docs" / "memory" / "plans.json"
Setting, RecordingFailed = memory.Setting, memory.RecordingFailed

# three settings the page continues from 4 and 5 blocks (most of its 8B settings are recorded
# at full depth, where the line is not known to hold): the peak in the second block's backward
# and at the root's; both world sizes and sequence lengths, each precision, every checkpointing
# but none, both reshards
PLANNED = [
    Setting("llama3-8b", 2048, 1, 8, "fp32", "block", True),
    Setting("llama3-8b", 8192, 1, 8, "bf16", "selective", True),
    Setting("llama3-8b", 8192, 1, 64, "fp32", "block", False),
]


@pytest.fixture(scope="module")
def data():
    return json.loads(DATA.read_text(encoding="utf-8"))


def test_the_data_is_what_the_planner_records_today(data):
    """One setting recorded again at 4 and 5 blocks and continued, as the script does (its
    cheapest kind: every block checkpointed, about 6 s)."""
    wrong = memory.stale([PLANNED[0]], data)
    assert not wrong, (
        "docs/memory/plans.json is not what the planner records today; record it again with "
        "`python benchmarks/memory_calculator.py --fresh`:\n" + "\n".join(wrong)
    )


@pytest.mark.full
@pytest.mark.parametrize("setting", PLANNED, ids=lambda s: s.key)
def test_the_page_shows_what_twinshard_plan_plans(setting, data):
    shown = data["settings"][setting.key]
    assert shown["command"] == setting.command()
    assert shown["recorded"] == list(depth.DEPTHS), "a setting continued from a small depth"
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    command_line = shown["command"].split()[2:]  # after "twinshard plan"
    (jobs,), wrong = plan_cli.configs_from(parser.parse_args([*command_line, "--no-progress"]))
    assert wrong is None
    (row,) = plan_cli.plan(jobs, progress=False, ideal=False)
    assert "error" not in row, row.get("error")
    planned = row["memory"]
    assert shown["parts"] == planned["parts"]
    assert shown["peak_bytes"] == planned["peak_bytes"]
    assert shown["peak_at"] == planned["peak_at"]
    assert (shown["params"], shown["blocks"]) == (row["model"]["params"], row["model"]["layers"])


def test_the_grid_covers_every_combination_it_declares(data):
    # in AXES' order: the page makes a setting's key from the axes in the order it reads them
    assert list(data["axes"].items()) == [(k, list(v)) for k, v in memory.AXES.items()]
    assert set(data["settings"]) == {s.key for s in memory.grid()}
    assert [d["key"] for d in data["devices"]] == ["a100", "h100", "h100-500w", "h200", "b200"]
    for setting in memory.grid():
        shown = data["settings"][setting.key]
        assert set(shown["parts"]) == {p["key"] for p in data["parts"]}
        assert shown["peak_bytes"] > shown["parts"]["sharded"] > 0
        assert shown["recorded"] in (list(depth.DEPTHS), [shown["blocks"]])


# --- the depth line, on made-up records ---------------------------------------------------------
def timeline(*runs) -> list:
    """Samples of a step: each (label, most bytes) as one sample."""
    return [(i, nbytes, label) for i, (label, nbytes) in enumerate(runs)]


def record(blocks: int, peak: str, params: int, runs: list, **parts) -> dict:
    every = dict.fromkeys(PARTS, 0) | parts
    top = max(nbytes for _, nbytes in runs)
    return {"peak_label": peak, "peak_bytes": top, "parts": every,
            "model": {"params": params}, "timeline": timeline(*runs)}  # fmt: skip


def step(blocks: int, start: int, end: int) -> list:
    """A step's places: the start of backward at ``start`` bytes, its end at ``end``."""
    middle = [(f"backward blocks.{i}", 10) for i in reversed(range(blocks))]
    return [("forward root", 5), ("backward root", start), *middle, ("backward root", end)]


def test_each_part_continues_its_line_to_the_models_depth():
    four = record(4, "backward blocks.3", 400, step(4, 1000, 900), sharded=140, activations=860)
    five = record(5, "backward blocks.4", 500, step(5, 1300, 1000), sharded=150, activations=1150)
    found = depth.continued([four, five], 32)
    assert found["parts"] == dict.fromkeys(PARTS, 0) | {"sharded": 420, "activations": 8980}
    assert found["peak_bytes"] == 1300 + 300 * 27
    assert (found["params"], found["blocks"]) == (3200, 32)
    assert found["peak_at"] == "backward blocks.31"  # the last block, as at both depths


def test_a_peak_another_place_overtakes_is_not_continued():
    # the end of backward peaks at 4 and 5 blocks; the start gains more with each block
    overtaken = [
        record(4, "backward root", 400, step(4, 900, 1000)),
        record(5, "backward root", 500, step(5, 1000, 1050)),
    ]
    assert depth.continued(overtaken, 32) is None  # the start: 3700 against the end's 2400
    kept = [  # the same, but the end gains more
        record(4, "backward root", 400, step(4, 900, 1000)),
        record(5, "backward root", 500, step(5, 950, 1100)),
    ]
    assert depth.continued(kept, 32)["peak_bytes"] == 1100 + 100 * 27


@pytest.mark.parametrize(
    "at_four, at_five, at_32",
    [
        ("backward root", "backward root", "backward root"),
        ("backward blocks.0", "backward blocks.0", "backward blocks.0"),  # from the first
        ("recompute blocks.2", "recompute blocks.3", "recompute blocks.30"),  # from the last
        ("backward root", "optimizer step", None),
        ("backward blocks.1", "recompute blocks.2", None),  # another hook
        ("backward blocks.0", "backward blocks.2", None),  # neither from the first nor the last
    ],
)
def test_only_a_peak_at_the_same_place_is_continued(at_four, at_five, at_32):
    assert depth.peak_place(at_four, 4, at_five, 5, 32) == at_32


def test_a_peak_that_moves_between_the_depths_is_not_continued():
    four = record(4, "backward blocks.0", 400, step(4, 900, 1000))
    five = record(5, "backward blocks.2", 500, step(5, 1000, 1050))
    assert depth.continued([four, five], 32) is None


def test_a_wrong_setting_is_named_with_the_commands_own_message():
    wrong = Setting("llama3-8b", 2048, 1, 8, "bf16", "sometimes", True)
    with pytest.raises(RecordingFailed, match="--ac sometimes.*--ac"):
        memory.plan_job(wrong)


def test_a_missing_combination_is_refused():
    axes = dict(memory.AXES, model=("llama3-8b",))
    with pytest.raises(ValueError, match="settings were not recorded"):
        memory.page_data({}, axes)


def test_the_build_refuses_a_site_without_the_data(tmp_path):
    pytest.importorskip("mkdocs")
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File, Files
    from mkdocs.structure.pages import Page

    hook = load_hook("memory")
    config = MkDocsConfig()
    config.load_dict({"site_name": "t", "docs_dir": str(tmp_path), "site_dir": str(tmp_path / "s")})
    (tmp_path / "memory.md").write_text("x", encoding="utf-8")
    page = Page(None, File("memory.md", str(tmp_path), str(tmp_path / "s"), True), config)
    with pytest.raises(PluginError, match="memory_calculator.py"):
        hook.on_page_content(hook.PLACE, page=page, config=config, files=Files([]))
    with pytest.raises(PluginError, match="has no <div"):
        hook.on_page_content("<p>no calculator</p>", page=page, config=config, files=Files([]))


# --- the page in a browser ------------------------------------------------------------------------
PROBE = """<!doctype html><html><body><pre id="result"></pre>
<iframe id="page" style="height:900px;border:0"></iframe><script>
const q = new URLSearchParams(location.search), frame = document.getElementById("page");
frame.style.width = q.get("width") + "px";
const report = (v) => { document.getElementById("result").textContent = JSON.stringify(v); };
function seen(root) {
  const doc = frame.contentDocument, win = frame.contentWindow;
  const shown = [...root.querySelectorAll("*")].filter((e) =>
    [...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim()));
  return {peak: root.querySelector(".tsm-peak-bytes").textContent,
          totals: [...root.querySelectorAll(".tsm-total")].map((e) => e.textContent),
          rows: root.querySelectorAll(".tsm-row").length,
          parts: [...root.querySelectorAll(".tsm-chosen .tsm-part")].map((e) =>
            ({part: e.dataset.part, width: e.getBoundingClientRect().width,
              height: e.getBoundingClientRect().height})),
          command: root.querySelector(".tsm-command").textContent,
          smallest_font: Math.min(...shown.map((e) => parseFloat(win.getComputedStyle(e).fontSize))),
          page_width: doc.documentElement.scrollWidth,
          frame_width: doc.documentElement.clientWidth};
}
function look(tries) {
  const root = frame.contentDocument.querySelector(".ts-memory");
  if (!root || !root.querySelector(".tsm-row")) {
    if (tries > 0) return setTimeout(() => look(tries - 1), 100);
    return report({error: root ? root.innerText.slice(0, 300) : "no .ts-memory"});
  }
  const before = seen(root);
  root.querySelector("button[data-axis='model'][data-value='llama3-70b']").click();
  report({before: before, after: seen(root)});
}
frame.onload = () => look(100);
frame.src = q.get("page");
</script></body></html>
"""


def gib(n: int) -> str:
    """What the page prints for ``n`` bytes (memory.js's ``gib``)."""
    return f"{n / 2**30:.{2 if n < 10 * 2**30 else 1}f} GiB"


@pytest.mark.parametrize("width", [420, 1400])
def test_the_page_draws_the_bars_and_fits_in_a_browser(
    site, server, browser, data, width, tmp_path
):
    assert json.loads((site / "memory" / "plans.json").read_text(encoding="utf-8")) == data
    built = (site / "memory" / "index.html").read_text(encoding="utf-8")
    scripts = re.findall(r'<script[^>]+src="([^"]+)"', built)
    assert "../js/memory.js" in scripts, scripts
    assert '<link rel="stylesheet" href="../css/memory.css"' in built
    (src,) = re.findall(r'<div class="ts-memory" data-src="([^"]+)">', built)
    assert urllib.parse.urljoin("/memory/", src) == "/memory/plans.json"
    seen = probe(site, server, tmp_path, "_memory_probe.html", PROBE, "/memory/", width, 20000)
    first = {axis: values[0] for axis, values in data["axes"].items()}
    for view, model in (("before", "llama3-8b"), ("after", "llama3-70b")):
        shown, choice = seen[view], {**first, "model": model}
        plan = data["settings"][Setting(**choice).key]
        assert shown["peak"] == gib(plan["peak_bytes"]), view
        assert shown["command"] == plan["command"], view
        assert shown["rows"] == len(data["axes"]["ac"]), view  # a bar per checkpointing
        drawn = {p["part"] for p in shown["parts"] if p["width"] >= 1 and p["height"] >= 10}
        assert drawn == {k for k, v in plan["parts"].items() if v > 0}, view
        assert shown["smallest_font"] >= 11, view
        assert shown["page_width"] <= shown["frame_width"], f"{view}: wider than the window"
    assert seen["before"]["peak"] != seen["after"]["peak"]
    assert seen["before"]["totals"] != seen["after"]["totals"]
